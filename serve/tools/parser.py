"""What every tool-call parser shares: a model's text in, its content and tool calls out,
whole (`extract`) or as the text streams (`feed`, then `finish`).

A parser is one pure function, `scan(text, final)`: the content so far (the text before the
tool calls), and each call seen so far with its name once the whole name is there and its
arguments' text as far as it can be sent without taking anything back. `feed` scans the
text so far after each delta and sends only what is new: content, then per call its name
(with a fresh id) and the new piece of its arguments. So the pieces of a stream add up to
what `extract` gives for the same text, however the text was split.

The arguments are the model's own JSON text, cut out of its output (not re-serialized), so
that a streamed call's pieces and the whole call agree to the character."""

from __future__ import annotations

import abc
import json
import re
import uuid
from dataclasses import dataclass, field

_DECODER = json.JSONDecoder()
ARGS_KEY = re.compile(r'"(arguments|parameters)"\s*:\s*')
NAME_KEY = re.compile(r'"name"\s*:\s*"((?:[^"\\]|\\.)*)"')
WHITESPACE = " \t\r\n"


def call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class Seen:
    """One call as far as the text shows it: name None until whole; args the part of its
    arguments' text that will not change; done when the call is whole."""

    name: str | None = None
    args: str = ""
    done: bool = False


@dataclass
class Scan:
    content: str
    calls: list[Seen] = field(default_factory=list)


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=call_id)

    def body(self) -> dict:
        """OpenAI's message.tool_calls entry."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def held(text: str, marker: str) -> int:
    """The length of the longest tail of text that begins marker (it may be forming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def before_marker(text: str, marker: str, final: bool) -> tuple[str, int]:
    """(content, where the marker starts or -1): the text before marker, a tail that may be
    its start held back unless final."""
    at = text.find(marker)
    if at >= 0:
        return text[:at], at
    return (text if final else text[:len(text) - held(text, marker)]), -1


def json_object(text: str, start: int) -> tuple[Seen, int]:
    """A call written as one JSON object {"name": ..., "arguments" (or "parameters"): {...}}
    at text[start]: what is seen of it, and where the object ends (-1: not yet whole)."""
    try:
        obj, end = _DECODER.raw_decode(text, start)
    except ValueError:
        obj, end = None, -1
    body = text[start:] if end < 0 else text[start:end]
    key = ARGS_KEY.search(body)
    if isinstance(obj, dict):
        name = obj.get("name")
        args = _value_text(body, key.end()) if key else "{}"
        return Seen(name if isinstance(name, str) else None, args or "", True), end
    seen = Seen()
    named = NAME_KEY.search(body, 0, key.start() if key else len(body))
    if named and (key is None or named.end() <= key.start()):
        seen.name = json.loads(f'"{named.group(1)}"')
    if key:
        whole = _value_text(body, key.end())
        # not whole yet: all the text after the key is its start (the object goes on only after it)
        seen.args = whole if whole is not None else body[key.end():]
    return seen, -1


def _value_text(body: str, at: int) -> str | None:
    """The JSON value's text at body[at], if it is whole."""
    try:
        _, end = _DECODER.raw_decode(body, at)
    except ValueError:
        return None
    return body[at:end]


def scan_objects(text: str, at: int, out: Scan, *, skip: str = WHITESPACE, sep: str | None = None) -> Scan:
    """The JSON objects from text[at] on, each a call into out.calls: the characters in `skip`
    come before each; with `sep`, each object after the first must follow one (whitespace
    around it). Stops at anything else, or inside an object not yet whole."""
    while True:
        while at < len(text) and text[at] in skip:
            at += 1
        if not text.startswith("{", at):
            return out
        seen, end = json_object(text, at)
        out.calls.append(seen)
        if end < 0:
            return out
        at = end
        if sep is not None:
            while at < len(text) and text[at] in WHITESPACE:
                at += 1
            if not text.startswith(sep, at):
                return out
            at += len(sep)


class ToolParser(abc.ABC):
    """One choice's parser (it keeps the stream's state): subclasses give scan()."""

    name = ""

    def __init__(self):
        self.text = ""
        self.sent_content = 0
        self.ids: list[str] = []  # per call sent: its id
        self.sent_args: list[int] = []

    @abc.abstractmethod
    def scan(self, text: str, final: bool) -> Scan:
        """The content and the calls seen in `text` so far (final: the whole output)."""

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        """The whole text's content (None when empty) and calls. Calls whose name is missing or
        whose arguments are not JSON make the whole text content, as vLLM's parsers do."""
        scan = self.scan(text, True)
        calls = []
        for seen in scan.calls:
            if not seen.name or not _is_json(seen.args):
                return text, []
            calls.append(ToolCall(seen.name, seen.args))
        if not calls:
            return text, []
        return scan.content or None, calls

    def feed(self, delta: str) -> tuple[str, list[dict]]:
        """The new content and tool-call deltas (OpenAI's: {index, id, type, function: {name,
        arguments}} first, then {index, function: {arguments}}) that delta adds."""
        self.text += delta
        return self._diff(self.scan(self.text, False))

    def finish(self) -> tuple[str, list[dict]]:
        """What the end of the text releases (held-back content, the last arguments)."""
        return self._diff(self.scan(self.text, True))

    @property
    def called(self) -> bool:
        return bool(self.ids)

    def _diff(self, scan: Scan) -> tuple[str, list[dict]]:
        content = scan.content[self.sent_content:]
        self.sent_content = max(self.sent_content, len(scan.content))
        out = []
        for k, seen in enumerate(scan.calls):
            if seen.name is None:
                break  # a call's name goes first; the later ones wait for it
            if k == len(self.ids):
                self.ids.append(call_id())
                self.sent_args.append(0)
                out.append({"index": k, "id": self.ids[k], "type": "function",
                            "function": {"name": seen.name, "arguments": ""}})
            piece = seen.args[self.sent_args[k]:]
            if piece:
                self.sent_args[k] = len(seen.args)
                out.append({"index": k, "function": {"arguments": piece}})
        return content, out


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True
