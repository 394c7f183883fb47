"""Function tools through the Responses API in-process (the app over a fake engine that emits
a Hermes-format text, SmolLM2's tokenizer with a template that renders tools, the real openai
client): the calls come back as function_call items, whole and streamed, the arguments'
deltas adding up; a follow-up with function_call_output items is the stored conversation
(the call an assistant turn, the output a tool message) through the template; Responses'
flat tools and tool_choice refused by their own names."""

import json

import pytest
from serving import with_tools_template
from test_serve_app import FakeEngine, run, serve
from test_serve_tool_parsers import CALLS, FORMATS

from atoll.engine.driver.llm import LLM

FLAT = [{"type": "function", "name": n, "description": f"the {n} tool", "parameters": None} for n, _ in CALLS]
CHAT = [{"type": "function", "function": {"name": n, "description": f"the {n} tool"}} for n, _ in CALLS]


@pytest.fixture(scope="module")
def llm(smollm2_dir, tmp_path_factory):
    """SmolLM2's files (linked) with a chat template that renders tools."""
    return LLM(with_tools_template(smollm2_dir, tmp_path_factory.mktemp("responses-tools") / "smol-tools"))


def scripted(llm, text):
    """A fake engine whose every request emits text's tokens, then the end-of-turn token."""
    ids = llm.tokenizer.encode(text, add_special_tokens=False) + [llm.tokenizer.eos_token_id]
    return FakeEngine(lambda req: ids, delay=0.002)  # about a token an event


def body(llm, **extra):
    return dict(model="tiny", input="Go.", tools=FLAT, max_output_tokens=400,
                extra_body={"stop_token_ids": [llm.tokenizer.eos_token_id]}, **extra)


def test_calls_whole_and_streamed_then_their_outputs_go_back_through_the_template(llm):
    engine = scripted(llm, FORMATS["hermes"]("Let me see. ", CALLS))

    async def go():
        _, client, _ = serve(llm, engine, tool_call_parser="hermes")
        whole = await client.responses.create(**body(llm))
        events = [e async for e in await client.responses.create(**body(llm), stream=True)]
        outputs = [{"type": "function_call_output", "call_id": o.call_id, "output": f"result of {o.name}"}
                   for o in whole.output if o.type == "function_call"]
        follow = await client.responses.create(**{**body(llm), "input": outputs}, previous_response_id=whole.id)
        return whole, events, follow

    whole, events, follow = run(go())
    assert [o.type for o in whole.output] == ["message"] + ["function_call"] * len(CALLS)
    assert whole.output_text == "Let me see. " and whole.status == "completed"
    calls = whole.output[1:]
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [(n, a) for n, a in CALLS]
    assert len({c.call_id for c in calls}) == len(CALLS) and all(c.call_id for c in calls)

    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed"
    streamed = events[-1].response.output
    assert [(o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in streamed] == \
        [(o.type, getattr(o, "name", None), getattr(o, "arguments", None)) for o in whole.output]
    for k, item in enumerate(streamed[1:], start=1):
        pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta" and e.output_index == k]
        done = [e.arguments for e in events if e.type == "response.function_call_arguments.done" and e.output_index == k]
        assert "".join(pieces) == item.arguments == done[0] and len(done) == 1
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    assert added == ["message"] + ["function_call"] * len(CALLS)

    first, again = engine.submitted[0], engine.submitted[-1]
    tok = llm.tokenizer
    said = [{"role": "user", "content": "Go."},
            {"role": "assistant", "content": "Let me see. ", "tool_calls": [
                {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": json.loads(c.arguments)}}
                for c in calls]}]
    said += [{"role": "tool", "tool_call_id": c.call_id, "content": f"result of {c.name}"} for c in calls]
    assert again.prompt_token_ids == tok.encode(tok.apply_chat_template(said, tools=CHAT), add_special_tokens=False)
    assert again.prompt_token_ids[:len(first.prompt_token_ids)] == first.prompt_token_ids
    assert "<tool_response" in tok.decode(again.prompt_token_ids) and follow.previous_response_id == whole.id


@pytest.mark.parametrize("extra, param", [
    ({"tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"tool_choice": {"type": "web_search_preview"}}, "tool_choice.type"),
    ({"tools": [{"type": "function", "name": "f", "parameters": "x"}]}, "tools[0].parameters"),
    ({"tools": [{"type": "file_search"}]}, "tools[0].type"),
    ({"tools": None, "tool_choice": "required"}, "tool_choice"),
])
def test_bad_tools_name_the_responses_field(llm, extra, param):
    async def go():
        _, _, http = serve(llm, FakeEngine(), tool_call_parser="hermes")
        return await http.post("/v1/responses", json={"input": "Go.", "tools": FLAT, **extra})

    err = run(go()).json()["error"]
    assert err["param"] == param and err["message"].startswith(param), err


def test_auto_without_a_parser_is_a_400_naming_tool_choice(llm):
    async def go():
        _, _, http = serve(llm, FakeEngine())
        return await http.post("/v1/responses", json={"input": "Go.", "tools": FLAT})

    r = run(go())
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice"
