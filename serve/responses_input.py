"""OpenAI's Responses API request (`POST /v1/responses`) and its input as chat messages.

`input` is text (one user message) or a list of items: messages (`role` user, system,
developer or assistant; content text or parts `input_text` / `output_text`), `function_call`
items (an earlier call of the model's, the assistant turn's tool_calls) and
`function_call_output` items (a tool's result, a `tool` message). Responses' flat function
tools and tool_choice become chat's (serve.tools.choice checks them). `instructions` is a system
message put first; it is not carried over to a follow-up (OpenAI's rule). `text.format` (text,
json_object, or the flat json_schema {name, schema, strict}) is chat's response_format.

The sampling fields chat has (seed, stop, top_k, min_tokens, ... vLLM's extensions) are taken
as well; a Responses field atoll cannot honour (background, reasoning effort, include,
conversation, prompt templates, truncation "auto", built-in tools, ...) is one 400 naming it."""

from __future__ import annotations

import json
import re
from typing import Any

from pydantic import Field

from atoll.serve.protocol import ApiError, _Common, _short

# Responses fields atoll does not honour, and when a value asks for them: each a 400 naming it
UNSUPPORTED = {
    "background": bool,
    "reasoning": lambda v: v is not None and any(v.get(k) for k in ("effort", "summary", "generate_summary")),
    "include": bool,
    "conversation": lambda v: v is not None,
    "prompt": lambda v: v is not None,
    "truncation": lambda v: v not in (None, "disabled"),
    "top_logprobs": bool,
    "context_management": lambda v: v is not None,
    "background_options": lambda v: v is not None,
}
# chat's names for what Responses names otherwise: a 400 that names the Responses field
RENAMED = {"max_tokens": "max_output_tokens", "max_completion_tokens": "max_output_tokens",
           "response_format": "text.format", "messages": "input"}
TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(_Common):
    input: str | list[dict]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    store: bool = True
    previous_response_id: str | None = None
    text: dict | None = None
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1)
    metadata: dict[str, str] | None = None
    # fields refused by name when asked for (UNSUPPORTED)
    background: bool | None = None
    reasoning: dict | None = None
    include: list | None = None
    conversation: Any = None
    prompt: Any = None
    truncation: str | None = None
    top_logprobs: int | None = None
    context_management: Any = None
    background_options: Any = None

    def refuse_unsupported(self) -> None:
        for name, given in UNSUPPORTED.items():
            if given(getattr(self, name)):
                raise ApiError(400, f"{name}={_short(getattr(self, name))} is not supported by atoll's Responses API",
                               param=name, code="unsupported")
        for name, ours in RENAMED.items():
            if name in self.model_fields_set:
                raise ApiError(400, f"{name} is chat's field: the Responses API takes {ours}", param=name)
        if self.n != 1:
            raise ApiError(400, f"n={self.n}: a response has one output; send n requests", param="n")
        self.response_format = text_format(self.text)

    # --- what Handler.start reads of a chat body ---

    @property
    def token_limit(self) -> int | None:
        return self.max_output_tokens

    @property
    def max_completion_tokens(self) -> int | None:
        return self.max_output_tokens

    @property
    def num_logprobs(self) -> None:
        return None

    @property
    def include_usage(self) -> bool:
        return True


def text_format(text: dict | None) -> dict | None:
    """`text.format` as chat's response_format (None: plain text)."""
    if text is None:
        return None
    fmt = text.get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ApiError(400, f"text.format={_short(fmt)} must be an object with a type", param="text.format")
    kind = fmt.get("type")
    if kind == "json_schema":
        if not isinstance(fmt.get("schema"), dict):
            raise ApiError(400, f"text.format.schema={_short(fmt.get('schema'))} must be a JSON schema (an object)",
                           param="text.format.schema")
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    if kind in ("text", "json_object"):
        return {"type": kind}
    raise ApiError(400, f"text.format.type={_short(kind)} must be text, json_object or json_schema",
                   param="text.format.type")


def renamed(e: ApiError) -> ApiError:
    """A refusal of the chat path naming the Responses fields instead of chat's (in its
    param and its message)."""
    param = e.param
    if param is not None and param.startswith(("tools[", "tool_choice.")):  # chat's tools nest under "function"
        param = param.replace(".function", "", 1)
    head, _, rest = (param or "").partition(".")
    if head in RENAMED:
        if head == "response_format":  # response_format.json_schema.schema: text.format.schema
            rest = rest.removeprefix("json_schema").lstrip(".")
        param = ".".join(x for x in (RENAMED[head], rest) if x)
    message = e.message.replace(e.param, param, 1) if param != e.param else e.message
    message = re.sub(r"\bmax_(completion_)?tokens\b", "max_output_tokens", message)
    message = message.replace("response_format", "text.format").replace("the messages", "the input")
    if (param, message) == (e.param, e.message):
        return e
    out = ApiError(e.status, message, param=param, type=e.type, code=e.code, retry_after=e.retry_after)
    out.counted = e.counted
    return out


def input_messages(given: str | list[dict]) -> list[dict]:
    """The request's input items as chat-template messages: a function_call item is an
    assistant turn's tool call (its arguments an object where they are JSON, as transformers'
    templates take them), a function_call_output item a tool message."""
    if isinstance(given, str):
        return [{"role": "user", "content": given}]
    if not given:
        raise ApiError(400, "input: give text or at least one input item", param="input")
    out: list[dict] = []
    for i, item in enumerate(given):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            out.append(_message(item, where))
        elif kind == "function_call_output":
            out.append({"role": "tool", "tool_call_id": _text(item, "call_id", where),
                        "content": _output(item.get("output"), f"{where}.output")})
        elif kind == "function_call":
            call = {"id": _text(item, "call_id", where), "type": "function",
                    "function": {"name": _text(item, "name", where), "arguments": _text(item, "arguments", where)}}
            said(out, call)
        else:
            raise ApiError(400, f"{where}.type={_short(kind)} is not supported by atoll: input items are message, "
                                "function_call and function_call_output", param=f"{where}.type")
    return out


def said(messages: list[dict], call: dict) -> None:
    """Add a tool call to the conversation: to the assistant turn just before (its text, or
    parallel calls: one turn), else as a new one."""
    call = {**call, "function": {**call["function"], "arguments": template_arguments(call["function"]["arguments"])}}
    if messages and messages[-1]["role"] == "assistant":
        messages[-1] = {**messages[-1], "tool_calls": [*(messages[-1].get("tool_calls") or ()), call]}
    else:
        messages.append({"role": "assistant", "content": "", "tool_calls": [call]})


def template_arguments(text: str):
    """A call's arguments as a template takes them: an object where the text is JSON."""
    try:
        return json.loads(text)
    except ValueError:
        return text


def chat_tool_choice(choice):
    """Responses' tool_choice as chat's: none, auto, required, or {"type": "function",
    "name"} as {"type": "function", "function": {"name"}}; any other kind a 400."""
    if choice is None or isinstance(choice, str):
        return choice
    kind = choice.get("type") if isinstance(choice, dict) else None
    if kind == "function":
        return {"type": "function", "function": {"name": choice.get("name")}}
    raise ApiError(400, f"tool_choice.type={_short(kind)} is not supported by atoll: give none, auto, required or "
                        '{"type": "function", "name": ...}', param="tool_choice.type")


def _message(item: dict, where: str) -> dict:
    role = item.get("role")
    if role not in ("user", "system", "developer", "assistant"):
        raise ApiError(400, f"{where}.role={_short(role)} must be user, system, developer or assistant",
                       param=f"{where}.role")
    content = item.get("content")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind not in TEXT_PARTS or not isinstance(part.get("text"), str):
                raise ApiError(400, f"{where}.content[{j}].type={_short(kind)} is not supported: atoll takes text "
                                    "parts (input_text, output_text)", param=f"{where}.content[{j}].type")
            texts.append(part["text"])
        content = "".join(texts)
    if not isinstance(content, str):
        raise ApiError(400, f"{where}.content={_short(content)} must be text or a list of text parts",
                       param=f"{where}.content")
    return {"role": "system" if role == "developer" else role, "content": content}


def _text(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{key}={_short(value)} must be a string", param=f"{where}.{key}")
    return value


def _output(value, where: str) -> str:
    """A tool's output: text, or a list of text parts (joined)."""
    if isinstance(value, str):
        return value
    if isinstance(value, list) and all(isinstance(p, dict) and p.get("type") in TEXT_PARTS for p in value):
        return "".join(p.get("text", "") for p in value)
    raise ApiError(400, f"{where}={_short(value)} must be text or a list of input_text parts", param=where)


def function_tools(tools: list | None) -> list[dict] | None:
    """Responses' flat function tools as chat's {"type": "function", "function": {...}}; any
    other tool type (web_search, file_search, ...) is a 400 naming it."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ApiError(400, f"tools[{i}].type={_short(kind)} is not supported by atoll: only function tools",
                           param=f"tools[{i}].type")
        if not isinstance(tool.get("name"), str) or not tool["name"]:
            raise ApiError(400, f"tools[{i}].name={_short(tool.get('name'))} must be a function name",
                           param=f"tools[{i}].name")
        fn = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": fn})
    return out
