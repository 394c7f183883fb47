"""A chat request's tools and tool_choice, checked (a 400 naming the field), and what they
ask of the output:

- "none": no call; the tools still go to the template (vLLM's default);
- "auto" (OpenAI's default when tools are given): the model decides, and the server's
  --tool-call-parser reads calls out of its text;
- "required": a grammar forces one call or more, a JSON array of {"name", "parameters"} over
  the tools' argument schemas (exactly one when parallel_tool_calls is false);
- {"type": "function", "function": {"name": ...}}: a grammar forces that function's
  arguments."""

from __future__ import annotations

from dataclasses import dataclass

from atoll.config.structured import StructuredOutputs
from atoll.errors import InputError
from atoll.serve.protocol import ApiError
from atoll.serve.tools import PARSERS
from atoll.serve.tools.forced import Named, Required
from atoll.serve.tools.parser import ToolParser

NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}  # a function without arguments


@dataclass(frozen=True)
class ToolPlan:
    tools: list[dict]  # as the template takes them: {"type": "function", "function": {...}}
    mode: str  # none, auto, required or named
    function: str | None = None  # the named function
    parallel: bool = True

    @property
    def schema(self) -> dict | None:
        """The JSON schema a grammar forces the output to (required and named), else None."""
        params = {t["function"]["name"]: t["function"].get("parameters") or NO_PARAMETERS for t in self.tools}
        if self.mode == "named":
            return params[self.function]
        if self.mode != "required":
            return None
        calls = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]}, "parameters": schema},
                  "required": ["name", "parameters"], "additionalProperties": False}
                 for name, schema in params.items()]
        array = {"type": "array", "minItems": 1, "items": calls[0] if len(calls) == 1 else {"anyOf": calls}}
        return {**array, "maxItems": 1} if not self.parallel else array

    def structured(self) -> StructuredOutputs | None:
        schema = self.schema
        return None if schema is None else StructuredOutputs(json=schema, source="tool_choice")

    def parser(self, auto: str | None) -> ToolParser | None:
        """A fresh parser for one choice's output (None: the output is only content)."""
        if self.mode == "named":
            return Named(self.function)
        if self.mode == "required":
            return Required()
        if self.mode == "auto":
            return PARSERS[auto]()
        return None


def plan_of(tools, tool_choice, parallel, *, parser: str | None, grammars=None) -> ToolPlan | None:
    """The request's ToolPlan (None without tools); grammars (engine.sample.grammar) checks
    each tool's parameters schema compiles."""
    if tools is None or tools == []:
        if tool_choice not in (None, "none"):
            raise ApiError(400, "tool_choice needs tools: the request gives none", param="tool_choice")
        return None
    checked = [_tool(k, t, grammars) for k, t in enumerate(tools)]
    names = [t["function"]["name"] for t in checked]
    dup = next((n for k, n in enumerate(names) if n in names[:k]), None)
    if dup is not None:
        raise ApiError(400, f"tools[{names.index(dup, names.index(dup) + 1)}].function.name={dup!r} is given twice",
                       param=f"tools[{names.index(dup, names.index(dup) + 1)}].function.name")
    if parallel is not None and not isinstance(parallel, bool):
        raise ApiError(400, f"parallel_tool_calls={parallel!r} must be true or false", param="parallel_tool_calls")
    parallel = True if parallel is None else parallel
    choice = "auto" if tool_choice is None else tool_choice
    if choice in ("none", "required"):
        return ToolPlan(checked, choice, parallel=parallel)
    if choice == "auto":
        if parser is None:
            raise ApiError(400, 'tool_choice="auto" needs the server started with --tool-call-parser (hermes, '
                                'llama3_json or deepseek_v3); "required" or a named function need none',
                           param="tool_choice")
        return ToolPlan(checked, "auto", parallel=parallel)
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict):
        name = choice["function"].get("name")
        if name not in names:
            raise ApiError(400, f"tool_choice.function.name={name!r} is not among the tools ({', '.join(names)})",
                           param="tool_choice.function.name")
        return ToolPlan(checked, "named", function=name, parallel=parallel)
    raise ApiError(400, f"tool_choice={_short(choice)} must be none, auto, required or "
                        '{"type": "function", "function": {"name": ...}}', param="tool_choice")


def _tool(k: int, tool, grammars) -> dict:
    """One tools entry checked: {"type": "function", "function": {"name", "description"?,
    "parameters"? (a JSON schema), "strict"?}}."""
    at = f"tools[{k}]"
    if not isinstance(tool, dict):
        raise ApiError(400, f"{at}={_short(tool)} must be an object", param=at)
    if tool.get("type", "function") != "function":
        raise ApiError(400, f"{at}.type={_short(tool.get('type'))} must be \"function\"", param=f"{at}.type")
    fn = tool.get("function")
    if not isinstance(fn, dict):
        raise ApiError(400, f"{at}.function must be an object with a name", param=f"{at}.function")
    name = fn.get("name")
    if not isinstance(name, str) or not name:
        raise ApiError(400, f"{at}.function.name is required: a non-empty string", param=f"{at}.function.name")
    if "description" in fn and not isinstance(fn["description"], (str, type(None))):
        raise ApiError(400, f"{at}.function.description must be a string", param=f"{at}.function.description")
    params = fn.get("parameters")
    if params is not None:
        field = f"{at}.function.parameters"
        if not isinstance(params, dict):
            raise ApiError(400, f"{field}={_short(params)} must be a JSON schema (an object)", param=field)
        if grammars is not None:
            try:
                grammars.check(StructuredOutputs(json=params, source=field))
            except InputError as e:
                raise ApiError(400, str(e), param=field) from None
    return {"type": "function", "function": fn}


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
