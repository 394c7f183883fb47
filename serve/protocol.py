"""The OpenAI request bodies atoll serves (pydantic, strict: `"5"` is not a number, `true`
is not 1), vLLM's /tokenize and /detokenize bodies, the error every refusal becomes, and a
request's SamplingParams.

Fields OpenAI defines and atoll cannot honour yet (suffix, best_of > 1, the older functions and
function_call, audio, prediction, web search) are refused by name with a 400 (UNSUPPORTED); unknown
fields are ignored, as OpenAI's other servers do. `response_format` (text, json_object,
json_schema) and vLLM's `structured_outputs` (json, regex, choice, grammar, json_object,
whitespace_pattern; its older `guided_*` fields too) constrain the output (structured_of).
Chat's `tools`, `tool_choice` and `parallel_tool_calls` are checked in serve/tools/choice.py;
a message may carry `tool_calls` (an assistant's) or `tool_call_id` (a tool's result).
Extensions (vLLM's names and meanings): `top_k`, `min_tokens`, `repetition_penalty`,
`stop_token_ids`, `bad_words`, `prompt_logprobs`, `ignore_eos`, `return_token_ids` (the
choice carries `token_ids` and `prompt_token_ids`)."""

from __future__ import annotations

import json
from dataclasses import fields
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from atoll.config.sampling import SamplingParams
from atoll.config.structured import StructuredOutputs
from atoll.errors import AtollError, InputError

MAX_LOGPROBS = 20
MAX_STOP = 16
MAX_N = 128  # OpenAI's limit


class ApiError(AtollError):
    """A request refused or failed: the HTTP status and OpenAI's error body."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 type: str = "invalid_request_error", code: str | None = None, retry_after: int | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type, code
        self.retry_after = retry_after
        self.counted = False  # already in the failed-requests counter

    def body(self) -> dict:
        return error_body(self.message, param=self.param, type=self.type, code=self.code)


def error_body(message: str, *, param: str | None = None, type: str = "invalid_request_error",
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class _Common(BaseModel):
    """The fields completions and chat share."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None  # None: the served model
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)  # -1 or 0: no top-k cut
    seed: int | None = Field(None, ge=0, le=2**64 - 1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    return_token_ids: bool = False
    n: int = Field(1, ge=1, le=MAX_N)  # choices per prompt: copies of it, each its own seed stream
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, Any] | None = None  # token id (as text, JSON's keys) -> bias
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    prompt_logprobs: int | None = None
    user: str | None = None
    response_format: dict | None = None
    structured_outputs: dict | None = None
    guided_json: Any = None  # vLLM's fields before v0.12: the same as structured_outputs' json, regex, ...
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_whitespace_pattern: Any = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v):
        stops = [v] if isinstance(v, str) else v or []
        if len(stops) > MAX_STOP:
            raise ValueError(f"at most {MAX_STOP} stop strings")
        if any(not s for s in stops):
            raise ValueError("stop strings must not be empty")
        return v

    def refuse_unsupported(self) -> None:
        for name, given in UNSUPPORTED.items():
            value = getattr(self, name, None)
            if given(value):
                raise ApiError(400, f"{name} is not supported by atoll yet", param=name, code="unsupported")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


# OpenAI's fields atoll does not honour yet, and when a value asks for them: each a 400 naming it
UNSUPPORTED = {
    "suffix": bool,
    "functions": bool,
    "function_call": lambda v: v not in (None, "none"),
    "audio": lambda v: v is not None,
    "modalities": lambda v: v not in (None, ["text"]),
    "prediction": lambda v: v is not None,
    "web_search_options": lambda v: v is not None,
}


class CompletionRequest(_Common):
    prompt: Any = None  # text, token ids, or a list of either (checked in prompts())
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=1)

    def prompts(self) -> list:
        """The prompts: text or token-id lists (one choice each)."""
        p = self.prompt
        if p is None:
            raise ApiError(400, "prompt is required: text, a list of token ids, or a list of those", param="prompt")
        if isinstance(p, str):
            return [p]
        if isinstance(p, list) and p and all(_is_id(t) for t in p):
            return [p]
        if isinstance(p, list) and p and all(isinstance(x, str) or (isinstance(x, list) and all(_is_id(t) for t in x))
                                             for x in p):
            return list(p)
        raise ApiError(400, f"prompt={_short(p)} must be text, a list of token ids, or a non-empty list of those",
                       param="prompt")


class ContentPart(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    type: Literal["text"]
    text: str


class FunctionCall(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    name: str
    arguments: str  # JSON text, as OpenAI sends it back


class ToolCallIn(BaseModel):
    """An assistant message's tool call, as the response gave it."""

    model_config = ConfigDict(strict=True, extra="ignore")
    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    tool_call_id: str | None = None

    def template_dict(self) -> dict:
        """The message as a chat template reads it: content as one string; a tool call's
        arguments as an object where they are JSON (as transformers' templates take them)."""
        content = self.content
        if isinstance(content, list):
            content = "".join(part.text for part in content)
        out = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.name:
            out["name"] = self.name
        if self.tool_calls:
            out["tool_calls"] = [{"id": c.id, "type": "function",
                                  "function": {"name": c.function.name, "arguments": _args(c.function.arguments)}}
                                 for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _args(text: str):
    try:
        return json.loads(text)
    except ValueError:
        return text  # the template gets the text as it came


class ChatRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    tools: list | None = None
    tool_choice: Any = None
    parallel_tool_calls: Any = None
    functions: list | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list | None = None
    prediction: Any = None
    web_search_options: Any = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs")

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize body: a prompt, or chat messages through the template."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # default: True for a prompt, False for messages (vLLM's)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    tools: list | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize body."""

    model_config = ConfigDict(strict=True, extra="ignore")
    model: str | None = None
    tokens: list[int]


# SamplingParams knows logprobs once the engine computes them (engine/driver/online.py's payload)
ENGINE_LOGPROBS = "logprobs" in {f.name for f in fields(SamplingParams)}


def sampling_params(req: _Common, *, max_tokens: int, logprobs: int | None) -> SamplingParams:
    """The request's SamplingParams, OpenAI's defaults where it gives none (temperature 1,
    top_p 1). A value SamplingParams refuses is a 400 naming its field."""
    prompt_logprobs = req.prompt_logprobs
    echo = getattr(req, "echo", False) and logprobs is not None  # echo with logprobs gives the prompt's (vLLM)
    if echo and (prompt_logprobs is None or prompt_logprobs >= 0):  # a negative one is refused below
        prompt_logprobs = max(prompt_logprobs or 0, logprobs)
    kwargs = dict(max_tokens=max_tokens, temperature=1.0 if req.temperature is None else req.temperature,
                  top_p=1.0 if req.top_p is None else req.top_p, top_k=max(req.top_k or 0, 0), seed=req.seed,
                  stop=tuple([req.stop] if isinstance(req.stop, str) else req.stop or ()),
                  ignore_eos=req.ignore_eos, n=req.n, min_tokens=req.min_tokens,
                  presence_penalty=req.presence_penalty or 0.0, frequency_penalty=req.frequency_penalty or 0.0,
                  repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
                  logit_bias=req.logit_bias, stop_token_ids=tuple(req.stop_token_ids or ()),
                  bad_words=tuple(req.bad_words or ()), prompt_logprobs=prompt_logprobs,
                  structured_outputs=structured_of(req))
    if logprobs is not None and ENGINE_LOGPROBS:
        kwargs["logprobs"] = logprobs
    try:
        return SamplingParams(**kwargs)
    except InputError as e:  # its messages start with `field=value`
        field = str(e).partition("=")[0].split("[")[0]
        raise ApiError(400, str(e), param=field if field in kwargs else None) from None


GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_of(req: _Common) -> StructuredOutputs | None:
    """The request's output constraint: from response_format (OpenAI's), structured_outputs
    (vLLM's), or vLLM's older guided_* fields; at most one of the three. A malformed one is a
    400 naming its field."""
    given = []
    rf = req.response_format
    if rf is not None and rf.get("type", "text") != "text":
        given.append(("response_format", _response_format(rf)))
    if req.structured_outputs is not None:
        given.append(("structured_outputs", dict(req.structured_outputs)))
    guided = {kind: getattr(req, name) for name, kind in GUIDED.items() if getattr(req, name) is not None}
    if guided:
        if req.guided_whitespace_pattern is not None:
            guided["whitespace_pattern"] = req.guided_whitespace_pattern
        given.append((f"guided_{next(iter(guided))}", guided))
    if not given:
        return None
    if len(given) > 1:
        raise ApiError(400, f"give one of {' and '.join(n for n, _ in given)}: both constrain the output",
                       param=given[1][0])
    name, fields_ = given[0]
    try:
        so = StructuredOutputs.of(fields_)
    except InputError as e:
        param = name if name != "structured_outputs" else str(e).partition("=")[0].partition(":")[0]
        raise ApiError(400, str(e) if name == "structured_outputs" else f"{name}: {str(e).partition(': ')[2] or e}",
                       param=param.split("{")[0]) from None
    if name == "structured_outputs":
        return so
    return StructuredOutputs(**{**{k: getattr(so, k) for k in ("json", "regex", "choice", "grammar", "json_object",
                                                                "whitespace_pattern")}, "source": name})


def _response_format(rf: dict) -> dict:
    """OpenAI's response_format as structured_outputs' fields."""
    kind = rf.get("type")
    if kind == "json_object":
        return {"json_object": True}
    if kind != "json_schema":
        raise ApiError(400, f"response_format.type={_short(kind)} must be text, json_object or json_schema",
                       param="response_format.type")
    spec = rf.get("json_schema")
    if not isinstance(spec, dict):
        raise ApiError(400, "response_format.json_schema must be an object holding the schema",
                       param="response_format.json_schema")
    schema = spec.get("schema", {"type": "object"})  # OpenAI: no schema, any object
    if not isinstance(schema, dict):
        raise ApiError(400, f"response_format.json_schema.schema={_short(schema)} must be a JSON schema (an object)",
                       param="response_format.json_schema.schema")
    return {"json": schema}


def _is_id(t) -> bool:
    return isinstance(t, int) and not isinstance(t, bool)


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def validation_error(errors: list[dict]) -> ApiError:
    """FastAPI's RequestValidationError as one 400 naming the first field at fault."""
    first = errors[0]
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        reason = (first.get("ctx") or {}).get("error", "invalid JSON")
        return ApiError(400, f"the request body is not valid JSON: {reason}", code="invalid_json")
    # union members and validators name themselves in loc ("str", "list[str]", "function-after[...]")
    path = [x for x in loc if (x.isidentifier() or x.isdigit()) and x not in _TYPE_TAGS]
    param = ".".join(path) or None
    msg = str(first.get("msg", "invalid")).removeprefix("Value error, ")
    if not path:
        return ApiError(400, f"the request body must be a JSON object: {msg}")
    value = first.get("input")
    shown = f"={_short(value)}" if isinstance(value, (int, float, str, bool)) and first.get("type") != "missing" else ""
    return ApiError(400, f"{param}{shown}: {msg}", param=param)
