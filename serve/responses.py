"""OpenAI's Responses API over the chat path: `POST /v1/responses` (whole or streamed),
`GET` and `DELETE /v1/responses/{id}`.

A request becomes chat messages (responses_input), goes through the chat Handler (its
sampling params, budget, structured outputs, and its collect or stream) and comes back as a
Response: `output` items (a `message` with `output_text`, then the `function_call`s chat's
tool calling read), `usage` with `input_tokens_details.cached_tokens`. Streamed, the chat chunks become
Responses' typed events (`response.created` ... `response.completed`), each with its
`sequence_number`.

A response is stored (unless `store: false`) with its conversation: the input's messages and
its output, without `instructions`. A follow-up naming it in `previous_response_id` is that
conversation plus its own input, so its prompt begins with the earlier prompt and the engine's
prefix cache reuses those blocks. The store lives in the server's memory, least recently used
first out past `size` responses."""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from dataclasses import dataclass

from fastapi import FastAPI, Request

from atoll.errors import CheckpointError
from atoll.serve.handlers import Handler
from atoll.serve.protocol import ApiError
from atoll.serve.responses_input import (ResponsesRequest, chat_tool_choice, function_tools, input_messages, renamed,
                                         said)
from atoll.serve.responses_stream import call_item, message_item, new_id, response_events
from atoll.serve.tools.choice import plan_of

STORE_SIZE = 1024  # responses kept for previous_response_id and GET


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


class Responses:
    """One server's Responses API: its request in, the chat Handler, the store."""

    def __init__(self, handler: Handler, served_names: list[str], *, size: int = STORE_SIZE,
                 parser: str | None = None):
        """parser: the server's --tool-call-parser (tool_choice "auto" reads calls with it)."""
        self.handler, self.backend, self.served = handler, handler.backend, served_names
        self.store = ResponseStore(size)
        self.parser = parser

    def prepare(self, body: ResponsesRequest):
        """The conversation's messages (without instructions), the prompt's token ids and the
        request's ToolPlan (serve.tools.choice; None without tools)."""
        if body.model is not None and body.model not in self.served:
            raise ApiError(400, f"model={body.model!r} is not served here; this server serves "
                                f"{', '.join(map(repr, self.served))}", param="model", code="model_not_found")
        plan = plan_of(function_tools(body.tools), chat_tool_choice(body.tool_choice), body.parallel_tool_calls,
                       parser=self.parser, grammars=self.backend.llm.grammars)
        history = []
        if body.previous_response_id is not None:
            stored = self.store.get(body.previous_response_id)
            if stored is None:
                raise ApiError(400, f"previous_response_id={body.previous_response_id!r}: no stored response has "
                                    "that id (unknown, not stored, or evicted)", param="previous_response_id",
                               code="previous_response_not_found")
            history = stored.messages
        messages = history + input_messages(body.input)
        tok = self.backend.llm.tokenizer
        if tok is None:
            raise ApiError(400, "this model has no tokenizer.json: the Responses API needs one", param="input")
        system = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
        try:
            text = tok.apply_chat_template(system + messages, tools=plan.tools if plan else None)
        except CheckpointError as e:
            raise ApiError(400, f"input: {e}", param="input") from None
        return messages, tok.encode(text, add_special_tokens=False), plan

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
        conversation = messages + [{"role": "assistant", "content": text}] if text or not calls else list(messages)
        for call in calls:
            said(conversation, call)
        self.store.put(Stored(response, conversation))

    async def create(self, body: ResponsesRequest, request: Request, *, on_disconnect):
        body.refuse_unsupported()
        try:
            messages, ids, plan = self.prepare(body)
            call, renderer = self.handler.start(body, [ids], chat=True, tools=plan, parser=self.parser)
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
        """The chat stream's chunks as Responses' events; the response stored at the end."""

        def finish(output, use, status, text, calls):
            final = self.response(body, rid, created, status=status, output=output, use=usage_of(use))
            self.keep(body, final, messages, text, calls)
            return final

        def fail(output, message):
            return self.response(body, rid, created, status="failed", output=output, use=None,
                                 error={"code": "server_error", "message": message})

        head = self.response(body, rid, created, status="in_progress", output=[], use=None)
        async for e in response_events(chunks, head, finish, fail):
            yield e


def mount_responses(app: FastAPI, handler: Handler, served_names: list[str], *, streaming, on_disconnect,
                    size: int = STORE_SIZE, tool_call_parser: str | None = None) -> Responses:
    """Add the Responses endpoints to app. streaming: the StreamingResponse class that closes
    its generator however the response ends; on_disconnect(request, then): the watch that
    aborts a whole response's engine request when its client goes."""
    api = Responses(handler, served_names, size=size, parser=tool_call_parser)

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
