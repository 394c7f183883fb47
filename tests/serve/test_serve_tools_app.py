"""Tool calling through the HTTP layer in-process (the app over a fake engine that emits the
tokens of a given text, SmolLM2's tokenizer): for each --tool-call-parser, a model's text in
its format comes back as OpenAI's tool_calls, whole and streamed token by token, with the
pieces adding up to the whole; parallel_tool_calls=false keeps the first call."""

import json

import pytest
from test_serve_app import FakeEngine, run, serve
from test_serve_tool_parsers import CALLS, FORMATS

from atoll.engine.driver.llm import LLM

TOOLS = [{"type": "function", "function": {"name": n}} for n, _ in CALLS]


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return LLM(smollm2_dir)


def scripted(llm, text):
    """A fake engine whose every request emits text's tokens, then the end-of-turn token."""
    ids = llm.tokenizer.encode(text, add_special_tokens=False) + [llm.tokenizer.eos_token_id]
    return FakeEngine(lambda req: ids, delay=0.002)  # about a token an event


async def ask(llm, engine, parser, **extra):
    _, client, _ = serve(llm, engine, tool_call_parser=parser)
    body = dict(model="tiny", messages=[{"role": "user", "content": "Go."}], tools=TOOLS, max_tokens=400,
                extra_body={"stop_token_ids": [llm.tokenizer.eos_token_id]}, **extra)
    whole = await client.chat.completions.create(**body)
    chunks = [c async for c in await client.chat.completions.create(**body, stream=True)]
    return whole.choices[0], [c.choices[0] for c in chunks if c.choices]


def streamed(choices):
    content, calls = "", {}
    for c in choices:
        content += c.delta.content or ""
        for t in c.delta.tool_calls or []:
            if t.id is not None:
                calls[t.index] = [t.id, t.function.name, t.function.arguments]
            else:
                calls[t.index][2] += t.function.arguments
    return content, [tuple(calls[k]) for k in sorted(calls)], choices[-1].finish_reason


@pytest.mark.parametrize("parser", list(FORMATS))
def test_each_parser_whole_and_streamed_token_by_token(llm, parser):
    text = FORMATS[parser]("Let me see. ", CALLS)
    whole, chunks = run(ask(llm, scripted(llm, text), parser))
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me see. "
    got = [(c.function.name, json.loads(c.function.arguments)) for c in whole.message.tool_calls]
    assert got == [(n, a) for n, a in CALLS]
    content, calls, reason = streamed(chunks)
    assert (content, reason) == ("Let me see. ", "tool_calls")
    assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments) for c in whole.message.tool_calls]
    assert len({i for i, _, _ in calls}) == len(CALLS)


def test_without_parallel_calls_the_first_is_kept(llm):
    text = FORMATS["hermes"]("", CALLS)
    whole, chunks = run(ask(llm, scripted(llm, text), "hermes", parallel_tool_calls=False))
    assert [c.function.name for c in whole.message.tool_calls] == [CALLS[0][0]]
    _, calls, reason = streamed(chunks)
    assert [n for _, n, _ in calls] == [CALLS[0][0]] and reason == "tool_calls"


def test_plain_text_stays_content(llm):
    text = "No tool is needed {really} <tool"
    whole, chunks = run(ask(llm, scripted(llm, text), "hermes"))
    assert whole.message.content == text and not whole.message.tool_calls and whole.finish_reason == "stop"
    assert streamed(chunks) == (text, [], "stop")


def test_tool_choice_none_reads_no_calls(llm):
    text = FORMATS["hermes"]("", CALLS[:1])
    whole, chunks = run(ask(llm, scripted(llm, text), "hermes", tool_choice="none"))
    assert whole.message.content == text and not whole.message.tool_calls and whole.finish_reason == "stop"
    assert streamed(chunks) == (text, [], "stop")
