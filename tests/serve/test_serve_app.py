"""The HTTP layer in-process over a fake engine (httpx.ASGITransport, the real openai client):
bodies, streams, stop strings and UTF-8 held back, logprobs, errors, queue limit, API key,
a failing engine and draining. The real engine is in test_serve_engine.py."""

import asyncio
import itertools
import json
import threading
import time

import httpx
import openai
import pytest
from serving import text_of, with_tokenizer

from atoll.engine.driver.llm import LLM
from atoll.serve.app import create_app
from atoll.serve.backend import Backend
from atoll.serve.metrics import DESCRIPTIONS
from atoll.serve.stream import TextStream

NAME = "tiny"


class FakeEngine:
    """OnlineEngine's interface: each request emits `script(request)` tokens from a thread,
    `delay` apart, each with a logprobs payload when the request asked (logprob -0.5 - i/10,
    top: the token and token+1); `hold` keeps every request from starting until set."""

    def __init__(self, script=None, *, delay: float = 0.0, logprobs: bool = False):
        self.script = script or (lambda req: [20 + i for i in range(req.params.max_tokens)])
        self.delay, self.logprobs = delay, logprobs
        self.error = None
        self.stats = {"running": 0, "waiting": 0, "blocks_in_use": 0, "blocks_cached": 0, "num_blocks": 64}
        self.hold = threading.Event()
        self.hold.set()
        self.aborted: set[int] = set()
        self.submitted = []
        self._ids = itertools.count()

    def new_id(self):
        return next(self._ids)

    def abort(self, index):
        self.aborted.add(index)

    def submit(self, request, sink):
        if self.error:
            from atoll.engine.driver.online import EngineDead

            raise EngineDead(self.error)
        self.submitted.append(request)
        threading.Thread(target=self._run, args=(request, sink), daemon=True).start()

    def _run(self, req, sink):
        self.hold.wait(30)
        out = []
        for i, t in enumerate(self.script(req)[: req.params.max_tokens]):
            if req.index in self.aborted:
                break
            if self.error:
                return sink("error", self.error)
            time.sleep(self.delay)
            lp = {"logprob": -0.5 - i / 10, "top": [(t, -0.5 - i / 10), (t + 1, -2.0)]} if self.logprobs else None
            sink("token", (t, lp))
            out.append(t)
            if t in req.params.stop_token_ids:
                break
        reason = "abort" if req.index in self.aborted else "stop" if out and out[-1] in req.params.stop_token_ids \
            else "length"
        sink("finish", {"token_ids": out, "finish_reason": reason,
                        "metrics": {"prompt_tokens": len(req.prompt_token_ids), "output_tokens": len(out),
                                    "cached_tokens": 16 if len(req.prompt_token_ids) > 16 else 0}})


@pytest.fixture(scope="module")
def model_dir(tiny_model, tmp_path_factory):
    return with_tokenizer(tiny_model("llama"), tmp_path_factory.mktemp("serve-app") / "m")


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(model_dir)


def serve(llm, engine, **kwargs):
    """(backend, openai client, raw httpx client) over the app in-process."""
    backend = Backend(llm, engine, max_waiting=kwargs.pop("max_waiting", None))
    app = create_app(backend, served_names=[NAME], **kwargs)
    http = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://serve.test")
    client = openai.AsyncOpenAI(base_url="http://serve.test/v1", api_key=kwargs.get("api_key") or "none",
                                http_client=http, max_retries=0)
    return backend, client, http


def run(coro):
    return asyncio.run(asyncio.wait_for(coro, 60))


def test_completion_text_usage_and_stream_agree(llm):
    async def go():
        _, client, _ = serve(llm, FakeEngine())
        full = await client.completions.create(model=NAME, prompt="w30 " * 20, max_tokens=5, temperature=0,
                                               extra_body={"return_token_ids": True})
        stream = await client.completions.create(model=NAME, prompt="w30 " * 20, max_tokens=5, temperature=0,
                                                 stream=True, stream_options={"include_usage": True})
        chunks = [c async for c in stream]
        return full, chunks

    full, chunks = run(go())
    assert full.choices[0].text == text_of(range(20, 25)) and full.choices[0].finish_reason == "length"
    assert full.choices[0].token_ids == [20, 21, 22, 23, 24] and full.choices[0].prompt_token_ids == [30] * 20
    assert full.usage.prompt_tokens == 20 and full.usage.completion_tokens == 5
    assert full.usage.prompt_tokens_details.cached_tokens == 16
    assert "".join(c.choices[0].text for c in chunks if c.choices) == full.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == 25


def test_chat_applies_the_template_and_streams_the_role_first(llm):
    async def go():
        _, client, _ = serve(llm, FakeEngine())
        messages = [{"role": "system", "content": "w8"}, {"role": "user", "content": [{"type": "text", "text": "w9"}]}]
        full = await client.chat.completions.create(model=NAME, messages=messages, max_tokens=4,
                                                    extra_body={"return_token_ids": True})
        chunks = [c async for c in await client.chat.completions.create(model=NAME, messages=messages,
                                                                        max_tokens=4, stream=True)]
        return full, chunks

    full, chunks = run(go())
    # <|system|> w8 <|end|> <|user|> w9 <|end|> <|assistant|>
    assert full.choices[0].prompt_token_ids == [3, 8, 6, 4, 9, 6, 5]
    assert full.choices[0].message.content == text_of([20, 21, 22, 23])
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == full.choices[0].message.content


def test_chat_without_max_tokens_gets_the_context_left(llm):
    engine = FakeEngine(lambda req: [20])

    async def go():
        _, client, _ = serve(llm, engine)
        await client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "w9"}])

    run(go())
    assert engine.submitted[0].params.max_tokens == llm.max_model_len - 4


def test_stop_string_is_held_back_and_cut(llm):
    # output words w20 w21 w22 w23 w24 ...; stop at "w22 w2" (text after "w22" can start it)
    async def go(stop):
        _, client, _ = serve(llm, FakeEngine(delay=0.01))
        full = await client.completions.create(model=NAME, prompt="w9", max_tokens=8, stop=stop)
        chunks = [c async for c in await client.completions.create(model=NAME, prompt="w9", max_tokens=8,
                                                                    stop=stop, stream=True)]
        return full.choices[0], [c.choices[0].text for c in chunks]

    choice, deltas = run(go(["w22 w2"]))
    assert choice.text == "w20 w21 " and choice.finish_reason == "stop"
    assert "".join(deltas) == choice.text
    assert all("w22" not in "".join(deltas[: i + 1]) for i in range(len(deltas)))
    # a tail that starts the stop string but does not finish it is sent once it can't
    choice, deltas = run(go(["w22 w9"]))
    assert choice.text == text_of(range(20, 28)) and "".join(deltas) == choice.text


def test_a_stop_string_counts_only_past_min_tokens(llm):
    """vLLM's rule: the text of the first min_tokens tokens is not searched for stop strings."""
    async def go(stream):
        _, client, _ = serve(llm, FakeEngine())
        body = dict(model=NAME, prompt="w9", max_tokens=6, stop=["w21"], extra_body={"min_tokens": 3})
        if not stream:
            return (await client.completions.create(**body)).choices[0].text
        return "".join([c.choices[0].text async for c in await client.completions.create(stream=True, **body)])

    assert run(go(False)) == run(go(True)) == text_of(range(20, 26))
    # and past them it stops as ever
    async def past():
        _, client, _ = serve(llm, FakeEngine())
        r = await client.completions.create(model=NAME, prompt="w9", max_tokens=6, stop=["w24"],
                                            extra_body={"min_tokens": 3})
        return r.choices[0]

    choice = run(past())
    assert choice.text == text_of(range(20, 24)) + " " and choice.finish_reason == "stop"


def test_text_stream_holds_back_incomplete_utf8(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from atoll.engine.batch.tokenizer import Tokenizer as AtollTokenizer

    tok = Tokenizer(models.BPE())  # the 256 bytes and no merges
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tok.train_from_iterator(["a"], trainer=trainers.BpeTrainer(vocab_size=len(alphabet), initial_alphabet=alphabet))
    tok.save(str(tmp_path / "tokenizer.json"))
    tokenizer = AtollTokenizer(tmp_path)
    text = "héllo wörld ✓ 猫"
    ids = tokenizer.encode(text)
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte: characters span tokens
    stream = TextStream(tokenizer, stop=("猫",))
    deltas = [stream.push([t]) for t in ids]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == "héllo wörld ✓ " and stream.stopped


def test_logprobs_render_in_both_shapes(llm):
    async def go():
        _, client, _ = serve(llm, FakeEngine(logprobs=True))
        comp = await client.completions.create(model=NAME, prompt="w9", max_tokens=3, logprobs=2)
        chat = await client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "w9"}],
                                                    max_tokens=3, logprobs=True, top_logprobs=2)
        chunks = [c async for c in await client.chat.completions.create(
            model=NAME, messages=[{"role": "user", "content": "w9"}], max_tokens=3, logprobs=True, stream=True)]
        return comp.choices[0].logprobs, chat.choices[0].logprobs, chunks

    comp, chat, chunks = run(go())
    assert comp.tokens == ["w20", "w21", "w22"] and comp.token_logprobs == pytest.approx([-0.5, -0.6, -0.7])
    assert comp.top_logprobs[1] == {"w21": pytest.approx(-0.6), "w22": -2.0} and comp.text_offset == [0, 3, 6]
    first = chat.content[0]
    assert first.token == "w20" and first.logprob == -0.5 and first.bytes == list(b"w20")
    assert [(t.token, t.logprob) for t in first.top_logprobs] == [("w20", -0.5), ("w21", -2.0)]
    streamed = [e.token for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert streamed == ["w20", "w21", "w22"]


def test_logprobs_without_engine_payloads_are_null(llm):
    async def go():
        _, client, _ = serve(llm, FakeEngine(logprobs=False))
        return await client.completions.create(model=NAME, prompt="w9", max_tokens=2, logprobs=1)

    assert run(go()).choices[0].logprobs is None


BAD = [
    ({"prompt": "w9", "max_tokens": 0}, "max_tokens", "max_tokens=0"),
    ({"prompt": "w9", "temperature": -1}, "temperature", "temperature=-1"),
    ({"prompt": "w9", "top_p": 1.5}, "top_p", "top_p=1.5"),
    ({"prompt": "w9", "logprobs": 21}, "logprobs", "logprobs=21"),
    ({"prompt": "w9", "max_tokens": "5"}, "max_tokens", "valid integer"),
    ({"prompt": "w9", "n": 0}, "n", "n=0"),
    ({"prompt": "w9", "n": 2, "temperature": 0}, "n", "n=2 needs temperature > 0"),
    ({"prompt": "w9", "presence_penalty": -3}, "presence_penalty", "presence_penalty=-3.0 must be in [-2, 2]"),
    ({"prompt": "w9", "frequency_penalty": 2.5}, "frequency_penalty", "frequency_penalty=2.5 must be in [-2, 2]"),
    ({"prompt": "w9", "repetition_penalty": -1}, "repetition_penalty", "repetition_penalty=-1.0 must be greater"),
    ({"prompt": "w9", "logit_bias": {"abc": 1}}, "logit_bias", "key 'abc' is not a token id"),
    ({"prompt": "w9", "logit_bias": {"5": 150}}, "logit_bias", "the bias of token 5 is 150"),
    ({"prompt": "w9", "logit_bias": {"301": 1}}, "logit_bias", "token 301 is outside the vocabulary"),
    ({"prompt": "w9", "bad_words": ["w8", ""]}, "bad_words", "bad_words[1]='' must be a non-empty string"),
    ({"prompt": "w9", "prompt_logprobs": 21}, "prompt_logprobs", "prompt_logprobs=21"),
    ({"prompt": "w9", "max_tokens": 4, "min_tokens": 5}, "min_tokens", "min_tokens=5 must be at most max_tokens=4"),
    ({"prompt": "w9", "min_tokens": 20}, "min_tokens", "min_tokens=20 is more than the 16 tokens"),
    ({"prompt": "w9", "suffix": "w8"}, "suffix", "suffix is not supported"),
    ({"prompt": "w9", "best_of": 2}, "best_of", "best_of=2"),
    ({"prompt": "w9", "model": "gpt-4"}, "model", "'gpt-4' is not served here"),
    ({"prompt": [5, 301]}, "prompt", "prompt[1]=301 is outside the vocabulary"),
    ({"prompt": "w9 " * 300}, "prompt", "prompt has 300 tokens; the context is 256"),
    ({"prompt": "w9", "max_tokens": 300}, "max_tokens", "room for 255 new tokens"),
    ({"prompt": {"a": 1}}, "prompt", "must be text"),
    ({"prompt": "w9", "stop": ["", "x"]}, "stop", "must not be empty"),
    ({}, "prompt", "prompt is required"),
]


@pytest.mark.parametrize("body,param,text", BAD, ids=[b[1] + str(i) for i, b in enumerate(BAD)])
def test_bad_completion_bodies_are_400_naming_the_field(llm, body, param, text):
    async def go():
        _, _, http = serve(llm, FakeEngine())
        return await http.post("/v1/completions", json=body)

    r = run(go())
    err = r.json()["error"]
    assert r.status_code == 400 and err["param"] == param and text in err["message"], err
    assert err["type"] == "invalid_request_error" and "\n" not in err["message"]


@pytest.mark.parametrize("content,param,text", [
    (b'{"prompt": "w9",', None, "not valid JSON"),
    (b'[1, 2]', None, "must be a JSON object"),
    (json.dumps({"messages": []}).encode(), "messages", "at least 1 item"),
    (json.dumps({"messages": [{"role": "robot", "content": "hi"}]}).encode(), "messages.0.role", "robot"),
    (json.dumps({"messages": [{"role": "user", "content": "w9"}], "top_logprobs": 2}).encode(), "top_logprobs",
     "needs logprobs"),
    (json.dumps({"messages": [{"role": "user", "content": "w9"}], "tools": [{"type": "function"}]}).encode(),
     "tools[0].function", "tools[0].function must be an object"),
    (json.dumps({"messages": [{"role": "user", "content": "w9"}], "tool_choice": "required"}).encode(),
     "tool_choice", "tool_choice needs tools"),
    (json.dumps({"messages": [{"role": "user", "content": "w9"}], "functions": [{"name": "f"}]}).encode(),
     "functions", "functions is not supported"),
    (json.dumps({"messages": [{"role": "user", "content": "w9"}], "modalities": ["text", "audio"]}).encode(),
     "modalities", "modalities is not supported"),
    (json.dumps({"messages": [{"role": "user", "content": "w9"}], "n": 2, "temperature": 0}).encode(),
     "n", "n=2 needs temperature > 0"),
])
def test_bad_chat_bodies(llm, content, param, text):
    async def go():
        _, _, http = serve(llm, FakeEngine())
        return await http.post("/v1/chat/completions", content=content, headers={"content-type": "application/json"})

    r = run(go())
    assert r.status_code == 400 and r.json()["error"]["param"] == param and text in r.json()["error"]["message"]


def test_a_full_queue_answers_429_with_retry_after(llm):
    engine = FakeEngine()
    engine.hold.clear()  # nothing gets a first token

    async def go():
        backend, client, http = serve(llm, engine, max_waiting=2)
        first = asyncio.create_task(http.post("/v1/completions", json={"prompt": "w9", "max_tokens": 1}))
        second = asyncio.create_task(http.post("/v1/completions", json={"prompt": "w9", "max_tokens": 1}))
        while backend.waiting < 2:
            await asyncio.sleep(0.01)
        third = await http.post("/v1/completions", json={"prompt": "w9", "max_tokens": 1})
        engine.hold.set()
        return third, await first, await second

    third, first, second = run(go())
    assert third.status_code == 429 and third.headers["retry-after"] == "1"
    assert third.json()["error"]["code"] == "queue_full" and first.status_code == second.status_code == 200


def test_api_key(llm):
    async def go():
        _, client, http = serve(llm, FakeEngine(), api_key="sekrit")
        ok = await client.completions.create(model=NAME, prompt="w9", max_tokens=1)
        wrong = await http.post("/v1/completions", json={"prompt": "w9"}, headers={"Authorization": "Bearer nope"})
        missing = await http.get("/v1/models")
        health = await http.get("/health")
        return ok, wrong, missing, health

    ok, wrong, missing, health = run(go())
    assert ok.choices[0].text and wrong.status_code == missing.status_code == 401 and health.status_code == 200
    assert wrong.json()["error"]["code"] == "invalid_api_key"


def test_models_and_metrics(llm):
    async def go():
        _, client, http = serve(llm, FakeEngine())
        models = await client.models.list()
        await client.completions.create(model=NAME, prompt="w9 " * 20, max_tokens=3)
        return models, (await http.get("/metrics")).text

    models, text = run(go())
    assert [m.id for m in models.data] == [NAME]
    for name in DESCRIPTIONS:
        assert f"atoll_{name}" in text, name
    assert 'atoll_requests_finished_total{finish_reason="length"} 1.0' in text
    assert "atoll_time_to_first_token_seconds_count 1.0" in text and "atoll_kv_blocks_total 64.0" in text
    assert "atoll_inter_token_latency_seconds_count 2.0" in text and "atoll_prefix_cache_hit_rate 0.8" in text


def test_an_engine_failure_ends_requests_with_the_rank(llm):
    engine = FakeEngine(delay=0.02)

    async def consume(stream):
        async for _ in await stream:
            pass

    async def go():
        backend, client, http = serve(llm, engine)
        # ASGITransport hands a response over whole: both requests run as tasks
        stream = asyncio.create_task(consume(client.completions.create(model=NAME, prompt="w9", max_tokens=200,
                                                                        stream=True)))
        plain = asyncio.create_task(http.post("/v1/completions", json={"prompt": "w9", "max_tokens": 200}))
        while len(engine.submitted) < 2:
            await asyncio.sleep(0.01)
        engine.error = "rank 1 on node0 failed: killed by SIGKILL"
        with pytest.raises(openai.APIError, match="rank 1 on node0 failed"):
            await stream
        return await plain, await http.get("/health"), await http.post("/v1/completions", json={"prompt": "w9"})

    plain, health, after = run(go())
    assert plain.status_code == 500 and "rank 1 on node0 failed" in plain.json()["error"]["message"]
    assert health.status_code == 503 and "rank 1" in health.json()["error"]
    assert after.status_code == 503 and after.json()["error"]["code"] == "engine_dead"


def test_draining_refuses_new_requests_and_fails_the_late_ones(llm):
    engine = FakeEngine(delay=0.02)

    async def go():
        backend, client, http = serve(llm, engine)
        stream = asyncio.create_task(http.post("/v1/completions", json={"prompt": "w9", "max_tokens": 200,
                                                                        "stream": True}))
        while not engine.submitted:
            await asyncio.sleep(0.01)
        backend.draining = "the server is shutting down"
        refused = await http.post("/v1/completions", json={"prompt": "w9"})
        backend.fail_all("the server shut down before this request finished")
        return refused, await stream

    refused, stream = run(go())
    assert refused.status_code == 503 and refused.headers["retry-after"] == "5"
    events = [line.removeprefix("data: ") for line in stream.text.splitlines() if line]
    assert "shut down before" in json.loads(events[-2])["error"]["message"] and events[-1] == "[DONE]"
    assert engine.aborted  # the late request was aborted in the engine
