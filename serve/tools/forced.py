"""The outputs of `tool_choice` "required" and a named function, which a grammar forces
(serve/tools/choice.py), read back as calls, whole or streamed as any parser's:

- required: a JSON array of {"name": ..., "parameters": {...}} (vLLM's shape), one or more;
- a named function: the output is the arguments object itself, the name known before it."""

from __future__ import annotations

from atoll.serve.tools.parser import WHITESPACE, Scan, Seen, ToolParser, json_object


class Required(ToolParser):
    name = "required"

    def scan(self, text: str, final: bool) -> Scan:
        out = Scan("")
        at = text.find("[")
        if at < 0:
            return out
        at += 1
        while True:
            while at < len(text) and text[at] in WHITESPACE + ",":
                at += 1
            if not text.startswith("{", at):
                return out
            seen, end = json_object(text, at)
            out.calls.append(seen)
            if end < 0:
                return out
            at = end


class Named(ToolParser):
    """tool_choice {"type": "function", "function": {"name": ...}}: every output is its call."""

    name = "named"

    def __init__(self, function: str):
        super().__init__()
        self.function = function

    def scan(self, text: str, final: bool) -> Scan:
        return Scan("", [Seen(self.function, text.lstrip(WHITESPACE), final)])
