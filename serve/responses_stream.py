"""A streamed response: the chat stream's chunks (server-sent `data:` lines) as the Responses
API's typed events, each `event: <type>` with its `sequence_number`.

Output items open as their first piece comes: a `message` (`response.output_item.added`,
`response.content_part.added`, then `response.output_text.delta`s) and, for each tool call,
a `function_call` (`response.output_item.added`, then
`response.function_call_arguments.delta`s). A call closes the message before it; text after
a call opens a new message. At the end every open item is closed (`...done` events) and the
stream ends with `response.completed`, `response.incomplete` (the token budget ran out) or
`response.failed` (the engine failed)."""

from __future__ import annotations

import json
import uuid

from atoll.serve.handlers import dumps


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def message_item(text: str, *, done: bool, item_id: str, incomplete: bool = False) -> dict:
    status = "incomplete" if incomplete else "completed" if done else "in_progress"
    return {"type": "message", "id": item_id, "status": status, "role": "assistant",
            "content": [text_part(text)] if done else []}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: dict, *, item_id: str, done: bool = True) -> dict:
    """A chat tool call ({id, function: {name, arguments}}) as a function_call item."""
    fn = call.get("function") or {}
    return {"type": "function_call", "id": item_id, "call_id": call.get("id"), "name": fn.get("name"),
            "arguments": fn.get("arguments") or "", "status": "completed" if done else "in_progress"}


class Events:
    """One response's events, numbered in order."""

    def __init__(self):
        self.seq = 0
        self.items: dict[int, dict] = {}  # output index -> the finished item
        self.message: dict | None = None  # the open message: {"id", "index", "text"}
        self.calls: dict[int, dict] = {}  # chat's tool-call index -> {"id", "index", "call"}
        self.texts: list[str] = []  # every message's text, in order

    def event(self, kind: str, **fields) -> str:
        self.seq += 1
        return f"event: {kind}\ndata: {dumps({'type': kind, 'sequence_number': self.seq - 1, **fields})}\n\n"

    @property
    def next_index(self) -> int:
        return len(self.items) + (self.message is not None) + sum(1 for c in self.calls.values() if not c["done"])

    def open_message(self):
        self.message = m = {"id": new_id("msg"), "index": self.next_index, "text": ""}
        yield self.event("response.output_item.added", output_index=m["index"],
                         item=message_item("", done=False, item_id=m["id"]))
        yield self.event("response.content_part.added", item_id=m["id"], output_index=m["index"],
                         content_index=0, part=text_part(""))

    def text(self, piece: str):
        if self.message is None:
            yield from self.open_message()
        m = self.message
        m["text"] += piece
        yield self.event("response.output_text.delta", item_id=m["id"], output_index=m["index"], content_index=0,
                         delta=piece, logprobs=[])

    def close_message(self, incomplete: bool = False):
        m, self.message = self.message, None
        if m is None:
            return
        item = message_item(m["text"], done=True, item_id=m["id"], incomplete=incomplete)
        yield self.event("response.output_text.done", item_id=m["id"], output_index=m["index"], content_index=0,
                         text=m["text"], logprobs=[])
        yield self.event("response.content_part.done", item_id=m["id"], output_index=m["index"], content_index=0,
                         part=text_part(m["text"]))
        yield self.event("response.output_item.done", output_index=m["index"], item=item)
        self.items[m["index"]] = item
        self.texts.append(m["text"])

    def tool_delta(self, tc: dict):
        """One chat tool-call delta: the first of a call names it, the rest add arguments."""
        yield from self.close_message()
        k = tc.get("index", 0)
        fn = tc.get("function") or {}
        if k not in self.calls:
            call = {"id": tc.get("id"), "type": "function", "function": {"name": fn.get("name"), "arguments": ""}}
            self.calls[k] = one = {"id": new_id("fc"), "index": self.next_index, "call": call, "done": False}
            yield self.event("response.output_item.added", output_index=one["index"],
                             item=call_item(call, item_id=one["id"], done=False))
        one = self.calls[k]
        piece = fn.get("arguments") or ""
        if piece:
            one["call"]["function"]["arguments"] += piece
            yield self.event("response.function_call_arguments.delta", item_id=one["id"],
                             output_index=one["index"], delta=piece)

    def close_calls(self):
        for one in self.calls.values():
            if one["done"]:
                continue
            one["done"] = True
            item = call_item(one["call"], item_id=one["id"])
            yield self.event("response.function_call_arguments.done", item_id=one["id"], output_index=one["index"],
                             arguments=item["arguments"])
            yield self.event("response.output_item.done", output_index=one["index"], item=item)
            self.items[one["index"]] = item

    @property
    def output(self) -> list[dict]:
        return [self.items[k] for k in sorted(self.items)]

    @property
    def tool_calls(self) -> list[dict]:
        return [self.calls[k]["call"] for k in sorted(self.calls)]


async def response_events(chunks, head: dict, finish, fail):
    """The chat stream `chunks` as Responses events. head: the response in progress;
    finish(output, usage, status, text, tool_calls): the final response (stored there);
    fail(output, message): the failed response. However it ends, chunks is closed (and with
    it the engine request)."""
    ev = Events()
    yield ev.event("response.created", response=head)
    yield ev.event("response.in_progress", response=head)
    reason, use = None, None
    try:
        async for raw in chunks:
            data = raw.removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            chunk = json.loads(data)
            if "error" in chunk:
                yield ev.event("response.failed", response=fail(ev.output, chunk["error"]["message"]))
                return
            use = chunk.get("usage") or use
            for c in chunk["choices"]:
                delta = c.get("delta") or {}
                if delta.get("content"):
                    for e in ev.text(delta["content"]):
                        yield e
                for tc in delta.get("tool_calls") or ():
                    for e in ev.tool_delta(tc):
                        yield e
                reason = c.get("finish_reason") or reason
        incomplete = reason == "length"
        if not ev.items and ev.message is None and not ev.calls:
            for e in ev.open_message():  # no output at all: one empty message, as a whole response has
                yield e
        for e in ev.close_message(incomplete):
            yield e
        for e in ev.close_calls():
            yield e
        status = "incomplete" if incomplete else "completed"
        final = finish(ev.output, use, status, "".join(ev.texts), ev.tool_calls)
        yield ev.event(f"response.{status}", response=final)
    finally:
        await chunks.aclose()
