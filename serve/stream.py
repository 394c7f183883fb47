"""From the engine's thread to the event loop, and from token ids to text deltas.

The engine calls a request's sink from its pump thread; `EventQueue.sink` hands each event to
the event loop (call_soon_threadsafe) with the time it arrived, and the loop's side counts it
(Backend) and queues it for the response that reads it.

`TextStream` turns a growing list of output ids into text deltas that never need taking
back: each push decodes the whole output so far and sends the new suffix, holding back an
incomplete UTF-8 character (the decoder's U+FFFD at the end) and any tail that could be the
start of a stop string. At a stop string the text ends before it, as `LLM.finish` cuts it,
so the deltas of a stream add up to the text of the same request without streaming.
"""

from __future__ import annotations

import asyncio
import time

REPLACEMENT = "\ufffd"


class EventQueue:
    """One HTTP request's events from its engine requests: (choice, kind, payload, time)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, on_event):
        self.loop, self.queue = loop, asyncio.Queue()
        self._on_event = on_event  # called on the loop first: counting and metrics

    def sink_for(self, choice: int):
        def sink(kind: str, payload) -> None:  # the engine's pump thread
            t = time.monotonic()
            try:
                self.loop.call_soon_threadsafe(self._put, choice, kind, payload, t)
            except RuntimeError:  # the loop is closed: nobody is listening any more
                pass
        return sink

    def _put(self, choice: int, kind: str, payload, t: float) -> None:
        self._on_event(choice, kind, payload, t)
        self.queue.put_nowait((choice, kind, payload, t))

    async def batch(self) -> list[tuple]:
        """The next event and every one already waiting behind it."""
        out = [await self.queue.get()]
        while not self.queue.empty():
            out.append(self.queue.get_nowait())
        return out


class TextStream:
    """Incremental detokenization of one choice, with stop strings held back."""

    def __init__(self, tokenizer, stop: tuple[str, ...] = (), *, min_tokens: int = 0):
        """min_tokens: a stop string counts only past the text of the first min_tokens tokens (vLLM)."""
        self.tokenizer, self.stop, self.min_tokens = tokenizer, stop, min_tokens
        self.ids: list[int] = []
        self.sent = ""  # text already sent
        self.stopped = False  # a stop string was reached: nothing more is sent

    def push(self, ids: list[int]) -> str:
        """The text the new ids add that is safe to send now ("" when nothing is)."""
        self.ids.extend(ids)
        if self.tokenizer is None or self.stopped:
            return ""
        text = self.tokenizer.decode(self.ids)
        end = len(text.rstrip(REPLACEMENT))  # an incomplete character waits for its next byte
        cut = None
        if len(self.ids) > self.min_tokens:
            start = len(self.tokenizer.decode(self.ids[:self.min_tokens])) if self.min_tokens else 0
            cut = _stop_at(text, self.stop, start)
        if cut is not None:
            self.stopped = True
            end = cut
        else:
            end -= _partial_stop(text[:end], self.stop)
        return self._send(text, end)

    def finish(self, text: str | None) -> str:
        """What is left to send of the request's final text (LLM.finish's, already cut)."""
        if text is None or self.stopped and len(text) <= len(self.sent):
            return ""
        return self._send(text, len(text))

    def _send(self, text: str, end: int) -> str:
        if end <= len(self.sent):
            return ""
        # by position: a decoder that rewrote earlier text cannot take back what was sent
        delta = text[len(self.sent):end]
        self.sent = text[:end]
        return delta


def _stop_at(text: str, stop: tuple[str, ...], start: int = 0) -> int | None:
    found = [i for i in (text.find(s, start) for s in stop) if i >= 0]
    return min(found) if found else None


def _partial_stop(text: str, stop: tuple[str, ...]) -> int:
    """The length of the longest tail of text that begins some stop string."""
    hold = 0
    for s in stop:
        for n in range(min(len(s) - 1, len(text)), hold, -1):
            if text.endswith(s[:n]):
                hold = n
                break
    return hold


def sse(data: str) -> str:
    """One server-sent event."""
    return f"data: {data}\n\n"
