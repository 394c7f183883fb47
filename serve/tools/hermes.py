"""Hermes' and Qwen's format (vLLM's `hermes`): each call a JSON object between tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

the text before the first tag the content. A call the model ends without its closing tag
(at its end-of-turn token) still counts once its object is whole."""

from __future__ import annotations

from atoll.serve.tools.parser import WHITESPACE, Scan, ToolParser, before_marker, held, json_object

START, END = "<tool_call>", "</tool_call>"


class Hermes(ToolParser):
    name = "hermes"

    def scan(self, text: str, final: bool) -> Scan:
        content, at = before_marker(text, START, final)
        out = Scan(content)
        while at >= 0:
            body = at + len(START)
            close = text.find(END, body)
            stop = close if close >= 0 else len(text) - (0 if final else held(text, END))
            start = _skip(text, body, stop)
            if start >= stop:
                break
            seen, _ = json_object(text[:stop], start)
            out.calls.append(seen)
            if close < 0:
                break
            nxt = _skip(text, close + len(END), len(text))
            at = nxt if text.startswith(START, nxt) else -1
        return out


def _skip(text: str, at: int, stop: int) -> int:
    while at < stop and text[at] in WHITESPACE:
        at += 1
    return at
