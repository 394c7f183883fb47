"""Tool calling through a real `atoll serve` of SmolLM2-135M-Instruct (its chat template
swapped for one that renders tools, Hermes' way) and the real openai client: a round trip
with tool_choice="required", then "auto" after the tool's result; "auto" reading a call out
of the model's text (the text forced into Hermes' format by a grammar), whole and streamed;
a named function and parallel_tool_calls=false; bad tools a 400 naming the field while the
server serves on."""

import asyncio
import json

import httpx
import jsonschema
import openai
import pytest
from serving import Server, with_tools_template

from atoll.serve.tools import PARSERS

NAME = "smol"
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12}},
           "required": ["city"], "additionalProperties": False}
ADD = {"type": "object", "properties": {"a": {"type": "integer", "minimum": -99, "maximum": 99},
                                        "b": {"type": "integer", "minimum": -99, "maximum": 99}},
       "required": ["a", "b"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "The weather in a city now",
                                           "parameters": WEATHER}},
         {"type": "function", "function": {"name": "add", "description": "a + b", "parameters": ADD}}]
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
# tool_choice "auto" over a text forced into Hermes' format: content first, then one call
FORCED = ('start: "Let me check. <tool_call>\\n{\\"name\\": \\"get_weather\\", \\"arguments\\": {\\"city\\": \\"" '
          '/[A-Z][a-z]{2,8}/ "\\"}}\\n</tool_call>"')


@pytest.fixture(scope="module")
def model(smollm2_dir, tmp_path_factory):
    """SmolLM2's files (linked) with a chat template that renders tools."""
    return with_tools_template(smollm2_dir, tmp_path_factory.mktemp("serve-tools") / "smol-tools")


@pytest.fixture(scope="module")
def server(model, tmp_path_factory):
    log = tmp_path_factory.mktemp("serve-tools-log") / "server.log"
    s = Server(model, "--served-model-name", NAME, "--max-model-len", "1024", "--tool-call-parser", "hermes", log=log)
    try:
        yield s
    finally:
        s.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=240)


def prompt_tokens(model, messages) -> int:
    """The prompt's length as transformers renders it (tool-call arguments as objects)."""
    from transformers import AutoTokenizer  # lazy: the reference

    plain = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
                               for c in m["tool_calls"]]
            m["content"] = m.get("content") or ""
        plain.append(m)
    ids = AutoTokenizer.from_pretrained(model).apply_chat_template(plain, tools=TOOLS, add_generation_prompt=True,
                                                                    tokenize=True, return_dict=True)["input_ids"]
    return len(ids)


def check_calls(message) -> list:
    assert message.tool_calls, message
    for c in message.tool_calls:
        assert c.type == "function" and c.id.startswith("call_")
        jsonschema.validate(json.loads(c.function.arguments), SCHEMAS[c.function.name])
    assert len({c.id for c in message.tool_calls}) == len(message.tool_calls)
    return message.tool_calls


def collect(chunks) -> tuple[str, list, str]:
    """A streamed choice: (content, [(id, name, arguments)], finish_reason), checking OpenAI's
    delta shape (id, type and name first; then arguments only)."""
    content, calls, reason = "", {}, None
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for t in d.tool_calls or []:
            if t.index not in calls:
                assert t.id and t.type == "function" and t.function.name and t.function.arguments == "", t
                calls[t.index] = [t.id, t.function.name, ""]
            else:
                assert t.id is None and t.function.name is None, t
                calls[t.index][2] += t.function.arguments
        reason = ch.choices[0].finish_reason or reason
    assert sorted(calls) == list(range(len(calls)))
    return content, [tuple(calls[k]) for k in sorted(calls)], reason


@pytest.mark.slow  # 4 s on a quiet machine, 31-100 s under load (it loads transformers too)
@pytest.mark.timeout(600)
def test_round_trip_required_then_auto_ending_in_the_tool_result(server, client, model):
    r = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0,
                                       max_tokens=120)
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    calls = check_calls(choice.message)
    assert r.usage.prompt_tokens == prompt_tokens(model, ASK)  # the tools went through the template
    told = httpx.post(f"{server.url}/tokenize", json={"messages": ASK, "tools": TOOLS}, timeout=60).json()
    assert told["count"] == r.usage.prompt_tokens

    turn = choice.message.model_dump(exclude_none=True)
    history = ASK + [turn] + [{"role": "tool", "tool_call_id": c.id, "content": "21 C and sunny"} for c in calls]
    r2 = client.chat.completions.create(model=NAME, messages=history, tools=TOOLS, tool_choice="auto", temperature=0,
                                        max_tokens=16)
    assert r2.usage.prompt_tokens == prompt_tokens(model, history)  # the call and its result, templated
    # auto is the hermes parser over the model's own text: the same prompt as a plain completion
    ids = httpx.post(f"{server.url}/tokenize", json={"messages": history, "tools": TOOLS}, timeout=60).json()["tokens"]
    raw = client.completions.create(model=NAME, prompt=ids, temperature=0, max_tokens=16).choices[0]
    content, expected = PARSERS["hermes"]().extract(raw.text)
    got = r2.choices[0].message
    assert got.content == content
    assert [(c.function.name, c.function.arguments) for c in got.tool_calls or []] == \
        [(c.name, c.arguments) for c in expected]
    assert r2.choices[0].finish_reason == ("tool_calls" if expected and raw.finish_reason == "stop"
                                           else raw.finish_reason)


@pytest.mark.timeout(300)
def test_auto_reads_the_call_out_of_the_text_whole_and_streamed(client):
    body = dict(model=NAME, messages=ASK, tools=TOOLS, temperature=0, max_tokens=60,
                extra_body={"structured_outputs": {"grammar": FORCED}})
    whole = client.chat.completions.create(**body).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Let me check. "
    (call,) = check_calls(whole.message)
    assert call.function.name == "get_weather"
    content, calls, reason = collect(client.chat.completions.create(**body, stream=True))
    assert (content, reason) == ("Let me check. ", "tool_calls")
    assert [(name, args) for _, name, args in calls] == [("get_weather", call.function.arguments)]


@pytest.mark.slow  # 2 s on a quiet machine, 60-80 s at load 7
@pytest.mark.timeout(300)
def test_required_streams_the_same_calls(client):
    body = dict(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required", temperature=0, max_tokens=200)
    whole = client.chat.completions.create(**body).choices[0]
    content, calls, reason = collect(client.chat.completions.create(**body, stream=True))
    assert content == "" and reason == "tool_calls"
    assert [(n, a) for _, n, a in calls] == [(c.function.name, c.function.arguments) for c in check_calls(whole.message)]


@pytest.mark.slow  # 2 s on a quiet machine, 60-80 s at load 7
@pytest.mark.timeout(300)
def test_named_function_and_one_call_without_parallel(client):
    named = client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "Add 2 and 3."}],
                                           tools=TOOLS, tool_choice={"type": "function", "function": {"name": "add"}},
                                           temperature=0.8, seed=1, n=3, max_tokens=60)
    one = client.chat.completions.create(model=NAME, messages=ASK, tools=TOOLS, tool_choice="required",
                                         parallel_tool_calls=False, temperature=0.8, seed=2, n=3, max_tokens=200)
    for choice in named.choices:
        calls = check_calls(choice.message)
        assert choice.finish_reason == "tool_calls" and [c.function.name for c in calls] == ["add"]
    for choice in one.choices:
        assert choice.finish_reason == "tool_calls" and len(check_calls(choice.message)) == 1


@pytest.mark.timeout(300)
def test_bad_tools_are_400_naming_the_field_and_the_server_serves_on(server):
    fn = {"type": "function", "function": {"name": "f"}}
    cases = [({"tools": [fn, {"type": "function", "function": {"description": "no name"}}]}, "tools[1].function.name"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
              "tools[0].function.parameters"),
             ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "object"}}]},
              "tools[0].function.parameters"),
             ({"tools": [fn], "tool_choice": {"type": "function", "function": {"name": "g"}}},
              "tool_choice.function.name"),
             ({"tool_choice": "required"}, "tool_choice"),
             ({"tools": [fn], "tool_choice": "required", "response_format": {"type": "json_object"}},
              "response_format"),
             ({"messages": [{"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f"}}]}]},
              "messages.0.tool_calls.0.function.arguments")]

    async def go():
        async with httpx.AsyncClient(timeout=120) as http:
            return await asyncio.gather(*[http.post(f"{server.url}/v1/chat/completions",
                                                    json={"messages": ASK, "max_tokens": 4, **body})
                                          for body, _ in cases])

    for r, (body, param) in zip(asyncio.run(go()), cases):
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and "\n" not in err["message"], (body, err)
    ok = httpx.post(f"{server.url}/v1/chat/completions", timeout=120,
                    json={"messages": ASK, "max_tokens": 40, "tools": [fn], "tool_choice": "required",
                          "parallel_tool_calls": False, "temperature": 1.0})
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["tool_calls"][0]["function"]["name"] == "f", ok.json()
