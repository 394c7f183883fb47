"""DeepSeek-V3's format (vLLM's `deepseek_v3`), in its own special tokens:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Paris"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

one call per <｜tool▁call▁begin｜>...<｜tool▁call▁end｜>; the text before the first token is the
content. The arguments are the text inside the json fence."""

from __future__ import annotations

from atoll.serve.tools.parser import WHITESPACE, Scan, Seen, ToolParser, before_marker, held

CALLS = "<｜tool▁calls▁begin｜>"
BEGIN, SEP, END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"
FENCE, CLOSE = "```json\n", "\n```"


class DeepSeekV3(ToolParser):
    name = "deepseek_v3"

    def scan(self, text: str, final: bool) -> Scan:
        content, at = before_marker(text, CALLS, final)
        out = Scan(content)
        if at < 0:
            return out
        at += len(CALLS)
        while True:
            while at < len(text) and text[at] in WHITESPACE:
                at += 1
            if not text.startswith(BEGIN, at):
                return out
            sep = text.find(SEP, at)
            line = text.find("\n", sep) if sep >= 0 else -1
            if line < 0:
                return out  # the name is not whole yet
            seen = Seen(text[sep + len(SEP):line].strip())
            out.calls.append(seen)
            if not final and FENCE.startswith(text[line + 1:]):
                return out  # the fence may be forming
            args = line + 1 + len(FENCE) if text.startswith(FENCE, line + 1) else line + 1
            end = text.find(END, args)
            if end < 0:
                tail = text[args:]
                seen.args = tail[:len(tail) - held(tail, CLOSE + END)]
                return out
            seen.args = text[args:end].removesuffix(CLOSE)
            seen.done = True
            at = end + len(END)
