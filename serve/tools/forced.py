"""The outputs of `tool_choice` "required" and a named function, which a grammar forces
(serve/tools/choice.py), read back as calls, whole or streamed as any parser's:

- required: a JSON array of {"name": ..., "parameters": {...}} (vLLM's shape), one or more;
- a named function: the output is the arguments object itself, the name known before it."""

from __future__ import annotations

from atoll.serve.tools.parser import WHITESPACE, Scan, Seen, ToolParser, scan_objects


class Required(ToolParser):
    name = "required"

    def scan(self, text: str, final: bool) -> Scan:
        out = Scan("")
        at = text.find("[")
        if at < 0:
            return out
        return scan_objects(text, at + 1, out, skip=WHITESPACE + ",")


class Named(ToolParser):
    """tool_choice {"type": "function", "function": {"name": ...}}: every output is its call."""

    name = "named"

    def __init__(self, function: str):
        super().__init__()
        self.function = function

    def scan(self, text: str, final: bool) -> Scan:
        return Scan("", [Seen(self.function, text.lstrip(WHITESPACE), final)])
