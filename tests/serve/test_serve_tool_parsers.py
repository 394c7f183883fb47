"""Tool calling without a server: each parser (hermes, llama3_json, deepseek_v3, and the
readers of the grammar-forced outputs) on texts written in its model's format, whole and
streamed in many splits (the pieces add up to the whole); the request's tools and
tool_choice checked, naming the field; the required grammar's schema; and tools with tool
calls and results through the chat template, as transformers renders them."""

import json
import random

import jsonschema
import pytest
from serving import TOOLS_TEMPLATE

from atoll.cli.serve import TOOL_CALL_PARSERS
from atoll.engine.batch.tokenizer import Tokenizer
from atoll.serve.protocol import ApiError, ChatMessage
from atoll.serve.tools import PARSERS
from atoll.serve.tools.choice import plan_of
from atoll.serve.tools.forced import Named, Required

CALLS = [("get_weather", {"city": "Paris", "note": 'a}b "q" {x} é'}),
         ("add", {"a": 2, "b": {"nested": [1, {"k": "}}"}]}}),
         ("noop", {})]


def hermes(content, calls, indent=None):
    return content + "".join(f"<tool_call>\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False, indent=indent)}"
                             "\n</tool_call>\n" for n, a in calls)


def llama3(content, calls, indent=None):
    body = "; ".join(json.dumps({"name": n, "parameters": a}, ensure_ascii=False, indent=indent) for n, a in calls)
    return f"{content}<|python_tag|>{body}" if content else body


def deepseek(content, calls, indent=None):
    return (content + "<｜tool▁calls▁begin｜>"
            + "".join(f"<｜tool▁call▁begin｜>function<｜tool▁sep｜>{n}\n```json\n"
                      f"{json.dumps(a, ensure_ascii=False, indent=indent)}\n```<｜tool▁call▁end｜>" for n, a in calls)
            + "<｜tool▁calls▁end｜>")


FORMATS = {"hermes": hermes, "llama3_json": llama3, "deepseek_v3": deepseek}


def stream(parser, text, sizes):
    """Feed text in pieces of the given sizes: (content, {index: [deltas]})."""
    content, deltas, at = "", {}, 0
    for size in sizes:
        c, d = parser.feed(text[at:at + size])
        content += c
        for x in d:
            deltas.setdefault(x["index"], []).append(x)
        at += size
    assert at >= len(text)
    c, d = parser.finish()
    for x in d:
        deltas.setdefault(x["index"], []).append(x)
    return content + c, deltas


def splits(text, seed):
    rng = random.Random(seed)
    return [rng.randint(1, 8) for _ in range(len(text))]


def check_stream(deltas, calls):
    """OpenAI's shape: per call, first {index, id, type, function: {name, arguments: ""}}, then
    argument pieces only; the pieces add up to the call's arguments."""
    assert sorted(deltas) == list(range(len(calls)))
    ids = set()
    for k, (name, args) in enumerate(calls):
        head, *rest = deltas[k]
        assert head["type"] == "function" and head["function"] == {"name": name, "arguments": ""}, head
        ids.add(head["id"])
        assert all(set(x) == {"index", "function"} and set(x["function"]) == {"arguments"} for x in rest)
        assert "".join(x["function"]["arguments"] for x in rest) == args
    assert len(ids) == len(calls)


def test_the_cli_offers_every_parser():
    assert TOOL_CALL_PARSERS == list(PARSERS)


@pytest.mark.parametrize("fmt", list(FORMATS))
@pytest.mark.parametrize("content,count,indent", [("", 1, None), ("Let me look that up. ", 2, None),
                                                  ("Checking.\n", 3, 2)])
def test_parser_whole_and_streamed_in_any_split(fmt, content, count, indent):
    calls = CALLS[:count]
    text = FORMATS[fmt](content, calls, indent)
    got_content, got = PARSERS[fmt]().extract(text)
    assert got_content == (content or None)
    assert [(c.name, json.loads(c.arguments)) for c in got] == calls
    if indent is None:  # the model's own text of the arguments, cut out of its output
        assert [c.arguments for c in got] == [json.dumps(a, ensure_ascii=False) for _, a in calls]
    expected = [(c.name, c.arguments) for c in got]
    for sizes in [[len(text)], [1] * len(text)] + [splits(text, seed) for seed in range(30)]:
        streamed, deltas = stream(PARSERS[fmt](), text, sizes)
        assert streamed == content, (sizes, streamed)
        check_stream(deltas, expected)


@pytest.mark.parametrize("fmt,text", [
    ("hermes", "The weather is fine {not a call} <tool"),
    ("hermes", 'Here: <tool_call>\n{"name": "f", "arguments": {"a": }\n</tool_call>'),  # not JSON
    ("llama3_json", "Use {braces} here; {\"name\": \"f\", \"parameters\": {}}"),  # prose first: no call
    ("deepseek_v3", "No tools needed <｜tool▁calls"),
])
def test_text_without_a_whole_call_is_content(fmt, text):
    assert PARSERS[fmt]().extract(text) == (text, [])
    streamed, _ = stream(PARSERS[fmt](), text, splits(text, 1))
    if "<tool_call>" not in text:
        assert streamed == text  # a marker's start held back is released at the end


def test_hermes_call_without_its_closing_tag_still_counts():
    text = 'Sure.<tool_call>\n{"name": "f", "arguments": {"x": 1}}'
    content, calls = PARSERS["hermes"]().extract(text)
    assert content == "Sure." and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}')]


def test_llama3_without_the_tag_and_with_arguments():
    text = ' {"name": "f", "arguments": {"x": [1, 2]}} ; {"parameters": {"y": "z"}, "name": "g"}'
    content, calls = PARSERS["llama3_json"]().extract(text)
    assert content == " " and [(c.name, c.arguments) for c in calls] == [("f", '{"x": [1, 2]}'), ("g", '{"y": "z"}')]
    _, deltas = stream(PARSERS["llama3_json"](), text, [1] * len(text))
    check_stream(deltas, [("f", '{"x": [1, 2]}'), ("g", '{"y": "z"}')])


def test_forced_readers():
    text = json.dumps([{"name": n, "parameters": a} for n, a in CALLS])
    content, calls = Required().extract(text)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == CALLS
    _, deltas = stream(Required(), text, splits(text, 3))
    check_stream(deltas, [(n, json.dumps(a)) for n, a in CALLS])
    args = json.dumps(CALLS[1][1])
    content, calls = Named("add").extract(args)
    assert content is None and [(c.name, c.arguments) for c in calls] == [("add", args)]
    _, deltas = stream(Named("add"), args, splits(args, 4))
    check_stream(deltas, [("add", args)])


TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Weather <now> & here, é",
                                           "parameters": {"type": "object", "properties": {"city": {"type": "string"}},
                                                          "required": ["city"]}}},
         {"type": "function", "function": {"name": "noop"}}]


def test_required_schema_takes_the_tools_and_one_call_without_parallel():
    one = plan_of(TOOLS, "required", False, parser=None).schema
    many = plan_of(TOOLS, "required", None, parser=None).schema
    call = {"name": "get_weather", "parameters": {"city": "Oslo"}}
    jsonschema.validate([call], one)
    jsonschema.validate([call, {"name": "noop", "parameters": {}}], many)
    for bad, schema in [([call, call], one), ([], many), ([{"name": "other", "parameters": {}}], many),
                        ([{"name": "get_weather", "parameters": {}}], many)]:
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    assert plan_of(TOOLS, {"type": "function", "function": {"name": "get_weather"}}, None,
                   parser=None).schema == TOOLS[0]["function"]["parameters"]
    assert plan_of(TOOLS, "auto", None, parser="hermes").schema is None


@pytest.mark.parametrize("tools,choice,param", [
    ([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"description": "x"}}],
     "required", "tools[1].function.name"),
    ([{"type": "function", "function": {"name": "a", "parameters": []}}], "required", "tools[0].function.parameters"),
    ([{"type": "retrieval"}], "required", "tools[0].type"),
    ([{"type": "function", "function": "a"}], "required", "tools[0].function"),
    ([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}], "required",
     "tools[1].function.name"),
    (TOOLS, {"type": "function", "function": {"name": "nope"}}, "tool_choice.function.name"),
    (TOOLS, "sometimes", "tool_choice"),
    (TOOLS, "auto", "tool_choice"),  # no --tool-call-parser
    (None, "required", "tool_choice"),
])
def test_bad_tools_name_the_field(tools, choice, param):
    with pytest.raises(ApiError) as e:
        plan_of(tools, choice, None, parser=None)
    assert e.value.status == 400 and e.value.param == param and "\n" not in e.value.message


def test_tools_and_tool_turns_go_through_the_template_as_transformers_renders_them(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer, models, pre_tokenizers
    from transformers import AutoTokenizer  # lazy: the reference

    tok = HFTokenizer(models.WordLevel({"<unk>": 0, "</s>": 1}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": TOOLS_TEMPLATE,
                                                                "eos_token": "</s>"}))
    args = {"city": "Paris <centre>"}
    body = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "call_1", "type": "function",
                 "function": {"name": "get_weather", "arguments": json.dumps(args)}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "21 C & sunny"}]
    ours = Tokenizer(tmp_path).apply_chat_template([ChatMessage(**m).template_dict() for m in body], tools=TOOLS)
    reference = [dict(m) for m in body]
    reference[2] = {**body[2], "content": "", "tool_calls": [{**body[2]["tool_calls"][0], "function": {
        "name": "get_weather", "arguments": args}}]}  # a template takes the arguments as an object
    theirs = AutoTokenizer.from_pretrained(tmp_path).apply_chat_template(reference, tools=TOOLS, tokenize=False,
                                                                         add_generation_prompt=True)
    assert ours == theirs
    assert '"description": "Weather <now> & here, é"' in ours and '<tool_response id="call_1">' in ours
    assert '{"name": "get_weather", "arguments": {"city": "Paris <centre>"}}' in ours
