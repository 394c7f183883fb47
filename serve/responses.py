"""OpenAI's Responses API over the chat path: `POST /v1/responses` (whole or streamed),
`GET` and `DELETE /v1/responses/{id}`.

A request becomes chat messages (responses_input), goes through the chat Handler (its
sampling params, budget, structured outputs, and its collect or stream) and comes back as a
Response: `output` items (a `message` with `output_text`, `function_call`s where tool calling
is on), `usage` with `input_tokens_details.cached_tokens`. Streamed, the chat chunks become
Responses' typed events (`response.created` ... `response.completed`), each with its
`sequence_number`.

A response is stored (unless `store: false`) with its conversation: the input's messages and
its output, without `instructions`. A follow-up naming it in `previous_response_id` is that
conversation plus its own input, so its prompt begins with the earlier prompt and the engine's
prefix cache reuses those blocks. The store lives in the server's memory, least recently used
first out past `size` responses."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import OrderedDict
from dataclasses import dataclass

from fastapi import FastAPI, Request

from atoll.errors import CheckpointError
from atoll.serve.handlers import Handler, dumps
from atoll.serve.protocol import ApiError
from atoll.serve.responses_input import ResponsesRequest, function_tools, input_messages, renamed

STORE_SIZE = 1024  # responses kept for previous_response_id and GET


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


@dataclass
class Stored:
    response: dict
    messages: list[dict]  # the conversation so far, this response's output included


class ResponseStore:
    """Responses by id, least recently used out first past `size`."""

    def __init__(self, size: int = STORE_SIZE):
        self.size, self.items = size, OrderedDict()

    def put(self, stored: Stored) -> None:
        self.items[stored.response["id"]] = stored
        self.items.move_to_end(stored.response["id"])
        while len(self.items) > self.size:
            self.items.popitem(last=False)

    def get(self, rid: str) -> Stored | None:
        stored = self.items.get(rid)
        if stored is not None:
            self.items.move_to_end(rid)
        return stored

    def pop(self, rid: str) -> Stored | None:
        return self.items.pop(rid, None)


def usage_of(chat_usage: dict | None) -> dict | None:
    """Chat's usage in Responses' names."""
    if chat_usage is None:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {"input_tokens": chat_usage["prompt_tokens"], "input_tokens_details": {"cached_tokens": cached},
            "output_tokens": chat_usage["completion_tokens"], "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": chat_usage["total_tokens"]}


def message_item(text: str, *, done: bool, item_id: str, incomplete: bool = False) -> dict:
    status = "incomplete" if incomplete else "completed" if done else "in_progress"
    content = [text_part(text)] if done else []
    return {"type": "message", "id": item_id, "status": status, "role": "assistant", "content": content}


def text_part(text: str) -> dict:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def call_item(call: dict, *, item_id: str, done: bool = True) -> dict:
    """A chat tool call ({id, function: {name, arguments}}) as a function_call item."""
    fn = call.get("function") or {}
    return {"type": "function_call", "id": item_id, "call_id": call.get("id"), "name": fn.get("name"),
            "arguments": fn.get("arguments") or "", "status": "completed" if done else "in_progress"}


class Responses:
    """One server's Responses API: its request in, the chat Handler, the store."""

    def __init__(self, handler: Handler, served_names: list[str], *, size: int = STORE_SIZE):
        self.handler, self.backend, self.served = handler, handler.backend, served_names
        self.store = ResponseStore(size)
        self.tools = False  # tool calling on the chat path: function tools pass through

    def prepare(self, body: ResponsesRequest) -> tuple[list[dict], list[int]]:
        """The conversation's messages (without instructions) and the prompt's token ids."""
        if body.model is not None and body.model not in self.served:
            raise ApiError(400, f"model={body.model!r} is not served here; this server serves "
                                f"{', '.join(map(repr, self.served))}", param="model", code="model_not_found")
        tools = function_tools(body.tools)
        if tools and not self.tools:
            raise ApiError(400, "tools are not supported by atoll yet", param="tools", code="unsupported")
        if body.tool_choice not in (None, "none", "auto"):
            raise ApiError(400, f"tool_choice={body.tool_choice!r} needs tools, which atoll does not take yet",
                           param="tool_choice", code="unsupported")
        history = []
        if body.previous_response_id is not None:
            stored = self.store.get(body.previous_response_id)
            if stored is None:
                raise ApiError(400, f"previous_response_id={body.previous_response_id!r}: no stored response has "
                                    "that id (unknown, not stored, or evicted)", param="previous_response_id",
                               code="previous_response_not_found")
            history = stored.messages
        messages = history + input_messages(body.input, tools=self.tools)
        tok = self.backend.llm.tokenizer
        if tok is None:
            raise ApiError(400, "this model has no tokenizer.json: the Responses API needs one", param="input")
        system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
        try:
            text = tok.apply_chat_template(system + messages)
        except CheckpointError as e:
            raise ApiError(400, f"input: {e}", param="input") from None
        return messages, tok.encode(text, add_special_tokens=False)

    def response(self, body: ResponsesRequest, rid: str, created: int, *, status: str, output: list,
                 use: dict | None, error: dict | None = None) -> dict:
        return {"id": rid, "object": "response", "created_at": created, "status": status, "error": error,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
                "model": body.model or self.served[0], "output": output, "parallel_tool_calls":
                body.parallel_tool_calls is not False, "previous_response_id": body.previous_response_id,
                "reasoning": {"effort": None, "summary": None}, "store": body.store,
                "temperature": 1.0 if body.temperature is None else body.temperature,
                "text": {"format": (body.text or {}).get("format") or {"type": "text"}},
                "tool_choice": body.tool_choice or "auto", "tools": body.tools or [],
                "top_p": 1.0 if body.top_p is None else body.top_p, "truncation": "disabled", "usage": use,
                "user": body.user, "metadata": body.metadata or {}}

    def keep(self, body: ResponsesRequest, response: dict, messages: list[dict], text: str, calls: list) -> None:
        """Store the response with its conversation (its output an assistant message)."""
        if not body.store:
            return
        said = {"role": "assistant", "content": text}
        if calls:
            said["tool_calls"] = calls
        self.store.put(Stored(response, messages + [said]))

    async def create(self, body: ResponsesRequest, request: Request, *, on_disconnect):
        body.refuse_unsupported()
        try:
            messages, ids = self.prepare(body)
            call, renderer = self.handler.start(body, [ids], chat=True)
        except ApiError as e:
            raise renamed(e) from None
        rid, created = new_id("resp"), int(time.time())
        if body.stream:
            return self.events(body, messages, self.handler.stream(call, renderer, include_usage=True), rid, created)
        watch = asyncio.create_task(on_disconnect(request, lambda: self.backend.end(call)))
        try:
            chat = await self.handler.collect(call, renderer)
        finally:
            watch.cancel()
            self.backend.end(call)
        choice = chat["choices"][0]
        text, calls = choice["message"].get("content") or "", choice["message"].get("tool_calls") or []
        incomplete = choice["finish_reason"] == "length"
        output = [call_item(c, item_id=new_id("fc")) for c in calls]
        if text or not calls:
            output.insert(0, message_item(text, done=True, item_id=new_id("msg"), incomplete=incomplete))
        out = self.response(body, rid, created, status="incomplete" if incomplete else "completed", output=output,
                            use=usage_of(chat["usage"]))
        self.keep(body, out, messages, text, calls)
        return out

    async def events(self, body: ResponsesRequest, messages: list[dict], chunks, rid: str, created: int):
        """The chat stream's chunks as Responses' events. However it ends, the chat stream is
        closed, and with it the engine request."""
        seq = 0

        def event(kind: str, **fields) -> str:
            nonlocal seq
            seq += 1
            return f"event: {kind}\ndata: {dumps({'type': kind, 'sequence_number': seq - 1, **fields})}\n\n"

        head = self.response(body, rid, created, status="in_progress", output=[], use=None)
        yield event("response.created", response=head)
        yield event("response.in_progress", response=head)
        msg_id, text, reason, use = new_id("msg"), "", None, None
        output: list[dict] = []
        calls: dict[int, dict] = {}  # tool call index -> chat's call, arguments growing
        opened = False
        try:
            async for raw in chunks:
                data = raw.removeprefix("data: ").strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    failed = self.response(body, rid, created, status="failed", output=output, use=None,
                                           error={"code": "server_error", "message": chunk["error"]["message"]})
                    yield event("response.failed", response=failed)
                    return
                use = usage_of(chunk.get("usage")) or use
                for c in chunk["choices"]:
                    delta = c.get("delta") or {}
                    piece = delta.get("content")
                    if piece:
                        if not opened:
                            opened = True
                            for e in self._open(event, msg_id, len(output)):
                                yield e
                        text += piece
                        yield event("response.output_text.delta", item_id=msg_id, output_index=len(output),
                                    content_index=0, delta=piece, logprobs=[])
                    for tc in delta.get("tool_calls") or ():
                        one = calls.setdefault(tc.get("index", 0), {"id": None, "type": "function",
                                                                   "function": {"name": None, "arguments": ""}})
                        one["id"] = tc.get("id") or one["id"]
                        fn = tc.get("function") or {}
                        one["function"]["name"] = fn.get("name") or one["function"]["name"]
                        one["function"]["arguments"] += fn.get("arguments") or ""
                    reason = c.get("finish_reason") or reason
            incomplete = reason == "length"
            if opened or not calls:
                if not opened:
                    for e in self._open(event, msg_id, len(output)):
                        yield e
                for e in self._close(event, msg_id, len(output), text, incomplete):
                    yield e
                output.append(message_item(text, done=True, item_id=msg_id, incomplete=incomplete))
            for _, tc in sorted(calls.items()):
                item = call_item(tc, item_id=new_id("fc"))
                index = len(output)
                yield event("response.output_item.added", output_index=index, item={**item, "arguments": "",
                                                                                   "status": "in_progress"})
                yield event("response.function_call_arguments.delta", item_id=item["id"], output_index=index,
                            delta=item["arguments"])
                yield event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"])
                yield event("response.output_item.done", output_index=index, item=item)
                output.append(item)
            final = self.response(body, rid, created, status="incomplete" if incomplete else "completed",
                                  output=output, use=use)
            self.keep(body, final, messages, text, [calls[k] for k in sorted(calls)])
            yield event("response.incomplete" if incomplete else "response.completed", response=final)
        finally:
            await chunks.aclose()

    @staticmethod
    def _open(event, msg_id: str, index: int):
        yield event("response.output_item.added", output_index=index,
                    item=message_item("", done=False, item_id=msg_id))
        yield event("response.content_part.added", item_id=msg_id, output_index=index, content_index=0,
                    part=text_part(""))

    @staticmethod
    def _close(event, msg_id: str, index: int, text: str, incomplete: bool):
        yield event("response.output_text.done", item_id=msg_id, output_index=index, content_index=0, text=text,
                    logprobs=[])
        yield event("response.content_part.done", item_id=msg_id, output_index=index, content_index=0,
                    part=text_part(text))
        yield event("response.output_item.done", output_index=index,
                    item=message_item(text, done=True, item_id=msg_id, incomplete=incomplete))


def mount_responses(app: FastAPI, handler: Handler, served_names: list[str], *, streaming, on_disconnect,
                    size: int = STORE_SIZE) -> Responses:
    """Add the Responses endpoints to app. streaming: the StreamingResponse class that closes
    its generator however the response ends; on_disconnect(request, then): the watch that
    aborts a whole response's engine request when its client goes."""
    api = Responses(handler, served_names, size=size)

    @app.post("/v1/responses")
    async def create(body: ResponsesRequest, request: Request):
        out = await api.create(body, request, on_disconnect=on_disconnect)
        if body.stream:
            return streaming(out, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        return out

    @app.get("/v1/responses/{rid}")
    async def retrieve(rid: str):
        stored = api.store.get(rid)
        if stored is None:
            raise ApiError(404, f"response_id={rid!r}: no stored response has that id", param="response_id",
                           code="not_found")
        return stored.response

    @app.delete("/v1/responses/{rid}")
    async def delete(rid: str):
        if api.store.pop(rid) is None:
            raise ApiError(404, f"response_id={rid!r}: no stored response has that id", param="response_id",
                           code="not_found")
        return {"id": rid, "object": "response", "deleted": True}

    return api
