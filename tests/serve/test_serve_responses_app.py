"""The Responses API in-process over test_serve_app's fake engine (the real openai client over
httpx.ASGITransport): a follow-up's prompt begins with the earlier prompt and its output, the
store's LRU bound and `store: false`, an engine failure mid-stream as `response.failed`, and the
chat-path refusals renamed to the Responses fields. The real model is in test_serve_responses.py."""

import asyncio
import time

import openai
import pytest
from serving import text_of, with_tokenizer
from test_serve_app import FakeEngine, run, serve

from atoll.engine.driver.llm import LLM
from atoll.serve.responses import ResponseStore, Stored

NAME = "tiny"


@pytest.fixture(scope="module")
def llm(tiny_model, tmp_path_factory):
    return LLM(with_tokenizer(tiny_model("llama"), tmp_path_factory.mktemp("serve-responses") / "m"))


def test_a_follow_up_prompt_extends_the_stored_conversation(llm):
    engine = FakeEngine()

    async def go():
        _, client, _ = serve(llm, engine)
        first = await client.responses.create(model=NAME, input="w30 w31 w32", instructions="w9", max_output_tokens=3)
        follow = await client.responses.create(model=NAME, input=[{"role": "user", "content": "w40"}],
                                               instructions="w9", max_output_tokens=2, previous_response_id=first.id)
        again = await client.responses.retrieve(follow.id)
        return first, follow, again

    first, follow, again = run(go())
    assert first.output_text == text_of([20, 21, 22]) and first.status == "incomplete"
    a, b = engine.submitted
    tok = llm.tokenizer
    said = [{"role": "system", "content": "w9"}, {"role": "user", "content": "w30 w31 w32"}]
    assert a.prompt_token_ids == tok.encode(tok.apply_chat_template(said), add_special_tokens=False)
    said += [{"role": "assistant", "content": first.output_text}, {"role": "user", "content": "w40"}]
    assert b.prompt_token_ids == tok.encode(tok.apply_chat_template(said), add_special_tokens=False)
    assert b.prompt_token_ids[:len(a.prompt_token_ids)] == a.prompt_token_ids
    assert again.output_text == follow.output_text == text_of([20, 21]) and again.id == follow.id


def test_the_store_drops_the_least_recently_used():
    store = ResponseStore(size=2)
    for rid in ("a", "b"):
        store.put(Stored({"id": rid}, []))
    assert store.get("a") is not None  # a is now the most recent
    store.put(Stored({"id": "c"}, []))
    assert store.get("b") is None and store.get("a") is not None and store.get("c") is not None
    assert len(store.items) == 2


def test_store_false_keeps_nothing_and_an_unknown_id_is_a_400(llm):
    async def go():
        _, client, http = serve(llm, FakeEngine())
        r = await client.responses.create(model=NAME, input="w30", max_output_tokens=2, store=False)
        got = await http.get(f"/v1/responses/{r.id}")
        follow = await http.post("/v1/responses", json={"input": "w31", "previous_response_id": r.id})
        return got, follow

    got, follow = run(go())
    assert got.status_code == 404 and got.json()["error"]["param"] == "response_id"
    assert follow.status_code == 400 and follow.json()["error"]["param"] == "previous_response_id"


def test_an_engine_failure_mid_stream_is_response_failed(llm):
    engine = FakeEngine()

    def failing(req, sink):  # two tokens, then (once they are sent) the engine dies
        sink("token", (20, None))
        sink("token", (21, None))
        time.sleep(0.3)
        sink("error", "rank 0 died")

    engine._run = failing

    async def go():
        _, client, _ = serve(llm, engine)
        stream = await client.responses.create(model=NAME, input="w30", max_output_tokens=8, stream=True)
        return [e async for e in stream]

    events = run(go())
    assert events[-1].type == "response.failed" and "rank 0 died" in events[-1].response.error.message
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == text_of([20, 21])


def test_chat_refusals_name_the_responses_field(llm):
    async def go():
        _, _, http = serve(llm, FakeEngine())
        long = await http.post("/v1/responses", json={"input": "w30", "max_output_tokens": 10 ** 6})
        words = await http.post("/v1/responses", json={"input": "w30", "max_output_tokens": 2, "min_tokens": 5})
        return long.json()["error"], words.json()["error"]

    long, words = run(go())
    assert long["param"] == "max_output_tokens" and long["message"].startswith("max_output_tokens=1000000: the input")
    assert words["param"] == "min_tokens" and words["message"].endswith("max_output_tokens=2")  # vLLM's, checked by the chat path


def test_concurrent_responses_are_stored_apart(llm):
    async def go():
        _, client, _ = serve(llm, FakeEngine())
        rs = await asyncio.gather(*[client.responses.create(model=NAME, input=f"w{30 + i}", max_output_tokens=1 + i)
                                    for i in range(4)])
        back = await asyncio.gather(*[client.responses.retrieve(r.id) for r in rs])
        return rs, back

    rs, back = run(go())
    assert [b.output_text for b in back] == [r.output_text for r in rs] == [text_of(range(20, 21 + i))
                                                                            for i in range(4)]
    assert len({r.id for r in rs}) == 4
