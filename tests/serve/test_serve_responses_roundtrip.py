"""A function-tool round trip through the Responses API on a real `atoll serve` of
SmolLM2-135M-Instruct (test_serve_tools' template that renders tools, the Hermes parser) and
the real openai client: tool_choice "required" gives the chat endpoint's calls, then a
follow-up by previous_response_id with the calls' outputs gives chat's "auto" answer to the
same conversation, its prompt's earlier part from the prefix cache."""

import json

import jsonschema
import openai
import pytest
from serving import Server
from test_serve_tools import ASK, NAME, SCHEMAS, TOOLS, model  # noqa: F401 (model: the fixture)

FLAT = [{"type": "function", **t["function"]} for t in TOOLS]
BLOCK = 16  # the engine's default block_size


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):  # noqa: F811
    log = tmp_path_factory.mktemp("serve-responses-tools") / "server.log"
    s = Server(model, "--served-model-name", NAME, "--max-model-len", "1024", "--tool-call-parser", "hermes", log=log)
    try:
        yield s
    finally:
        s.kill()


@pytest.mark.slow  # a server start and two exchanges: 100-200 s under load
@pytest.mark.timeout(600)
def test_required_then_the_outputs_by_previous_response_id(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=300)
    first = client.responses.create(model=NAME, input=ASK, tools=FLAT, tool_choice="required", temperature=0,
                                    max_output_tokens=120)
    chat = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                          temperature=0, max_tokens=120).choices[0].message
    calls = [o for o in first.output if o.type == "function_call"]
    assert calls and [(c.name, c.arguments) for c in calls] == [(c.function.name, c.function.arguments)
                                                                for c in chat.tool_calls]
    for c in calls:
        jsonschema.validate(json.loads(c.arguments), SCHEMAS[c.name])

    outputs = [{"type": "function_call_output", "call_id": c.call_id, "output": "21 C and sunny"} for c in calls]
    follow = client.responses.create(model=NAME, input=outputs, tools=FLAT, previous_response_id=first.id,
                                     temperature=0, max_output_tokens=16)
    turn = {"role": "assistant", "content": None, "tool_calls": [
        {"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}} for c in calls]}
    history = ASK + [turn] + [{"role": "tool", "tool_call_id": c.call_id, "content": "21 C and sunny"} for c in calls]
    want = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, tool_choice="auto",
                                          temperature=0, max_tokens=16)
    got_calls = [(o.name, o.arguments) for o in follow.output if o.type == "function_call"]
    assert follow.output_text == (want.choices[0].message.content or "")
    assert got_calls == [(c.function.name, c.function.arguments) for c in want.choices[0].message.tool_calls or []]
    assert follow.usage.input_tokens == want.usage.prompt_tokens > first.usage.input_tokens
    assert follow.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // BLOCK * BLOCK
