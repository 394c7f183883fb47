"""The FastAPI app: OpenAI's /v1/models, /v1/completions and /v1/chat/completions over a
Backend, vLLM's /tokenize and /detokenize, plus /health and /metrics. `create_app(backend, ...)` takes the Backend (an LLM and
its living engine), so tests can run it in-process over a fake engine (httpx.ASGITransport).

Every refusal is OpenAI's error body {"error": {message, type, param, code}}: 400 for a bad
body (naming the field), 401 for a wrong API key, 429/503 with Retry-After when the queue is
full or the server cannot take work. Streams are server-sent events ending in `[DONE]`; an
error after the stream began is one `{"error": ...}` event before it."""

from __future__ import annotations

import asyncio
import secrets
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException

from atoll.errors import CheckpointError
from atoll.serve.admin import mount_admin
from atoll.serve.backend import Backend
from atoll.serve.handlers import Handler
from atoll.serve.protocol import (ApiError, ChatRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest,
                                  error_body, validation_error)
from atoll.serve.responses import mount_responses
from atoll.serve.tools.choice import plan_of


class EngineStream(StreamingResponse):
    """A stream whose generator is closed however the response ends (a client gone, a task
    cancelled), so its engine requests are aborted at once, not at garbage collection."""

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()


class ApiKey:
    """ASGI middleware: /v1/* and /admin/* need `Authorization: Bearer <key>`; /health and /metrics don't."""

    def __init__(self, app, key: str):
        self.app, self.expected = app, f"Bearer {key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(("/v1", "/admin")):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not secrets.compare_digest(given, self.expected):
                body = error_body("invalid or missing API key: send `Authorization: Bearer <key>`",
                                  code="invalid_api_key")
                await JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(backend: Backend, *, served_names: list[str], api_key: str | None = None,
               tool_call_parser: str | None = None, admin=None) -> FastAPI:
    """tool_call_parser: how tool_choice "auto" reads calls out of the text (serve.tools.PARSERS);
    admin: the engines' admin API (serve.admin.EngineAdmin), mounted at /admin/engines."""
    app = FastAPI(title="atoll", docs_url=None, redoc_url=None, openapi_url=None)
    metrics = backend.metrics
    handler = Handler(backend, model=served_names[0])
    created = int(time.time())

    def refused(e: ApiError) -> JSONResponse:
        if not e.counted:
            metrics.failed.labels("invalid" if e.status < 429 else "rejected" if e.status in (429, 503)
                                  else "engine").inc()
        headers = {"Retry-After": str(e.retry_after)} if e.retry_after is not None else None
        return JSONResponse(e.body(), status_code=e.status, headers=headers)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError):
        return refused(e)

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, e: RequestValidationError):
        return refused(validation_error(list(e.errors())))

    @app.exception_handler(HTTPException)
    async def _http(request: Request, e: HTTPException):
        return JSONResponse(error_body(f"{request.method} {request.url.path}: {e.detail}",
                                       code=str(e.status_code)), status_code=e.status_code)

    def check_model(name: str | None) -> None:
        if name is not None and name not in served_names:
            raise ApiError(400, f"model={name!r} is not served here; this server serves "
                                f"{', '.join(map(repr, served_names))}", param="model", code="model_not_found")

    @app.get("/health")
    async def health():
        restarting = getattr(backend.engine, "restarting", None)
        if restarting and backend.healthy:  # nothing serves until the engine is back; requests are held
            return JSONResponse({"status": "restarting", "error": restarting}, status_code=503,
                                headers={"Retry-After": "5"})
        if backend.healthy:
            # replicas, or a disaggregated job's engines: some died, the rest serve
            dead = getattr(backend.engine, "degraded", None)
            if dead:
                out = {"status": "degraded", "dead": {str(r): line for r, line in dead.items()}}
                if hasattr(backend.engine, "engines"):
                    out["replicas"] = len(backend.engine.engines)
                return out
            engines = getattr(backend.engine, "engines", ())
            lost = getattr(engines[0], "degraded", None) if len(engines) == 1 else None
            if lost:  # one engine that heals, serving without ranks it lost (--elastic-ep)
                return {"status": "degraded", "dead": {str(r): line for r, line in lost.items()}}
            return {"status": "ok"}
        reason = backend.engine.error or backend.draining
        return JSONResponse({"status": "unavailable", "error": reason}, status_code=503)

    @app.get("/metrics")
    async def prometheus():
        data, content_type = metrics.render()
        return Response(data, media_type=content_type)

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "atoll",
                                            "max_model_len": backend.llm.max_model_len} for name in served_names]}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request):
        body.refuse_unsupported()
        check_model(body.model)
        return await respond(request, body, body.prompts(), chat=False)

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request):
        body.refuse_unsupported()
        check_model(body.model)
        tok = backend.llm.tokenizer
        if tok is None:
            raise ApiError(400, "this model has no tokenizer.json: chat needs one (use /v1/completions with "
                                "token ids)", param="messages")
        plan = plan_of(body.tools, body.tool_choice, body.parallel_tool_calls, parser=tool_call_parser,
                       grammars=backend.llm.grammars)
        try:
            text = tok.apply_chat_template([m.template_dict() for m in body.messages],
                                           tools=plan.tools if plan else None)
        except CheckpointError as e:
            raise ApiError(400, f"messages: {e}", param="messages") from None
        return await respond(request, body, [tok.encode(text, add_special_tokens=False)], chat=True, tools=plan)

    def tokenizer():
        tok = backend.llm.tokenizer
        if tok is None:
            raise ApiError(400, "this model has no tokenizer.json", param="model")
        return tok

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest):
        """vLLM's: a prompt's token ids (or chat messages' through the template), their count
        and the context."""
        check_model(body.model)
        tok = tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give prompt (text) or messages, not both", param="prompt")
        if body.prompt is not None:
            ids = tok.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
        else:
            plan = plan_of(body.tools, "none", None, parser=None)
            try:
                text = tok.apply_chat_template([m.template_dict() for m in body.messages],
                                               add_generation_prompt=body.add_generation_prompt,
                                               continue_final_message=body.continue_final_message,
                                               tools=plan.tools if plan else None)
            except CheckpointError as e:
                raise ApiError(400, f"messages: {e}", param="messages") from None
            ids = tok.encode(text, add_special_tokens=bool(body.add_special_tokens))
        return {"count": len(ids), "max_model_len": backend.llm.max_model_len, "tokens": ids,
                "token_strs": tok.token_strings(ids) if body.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest):
        """vLLM's: token ids' text."""
        check_model(body.model)
        tok, vocab = tokenizer(), backend.llm.config.vocab_size
        bad = next((j for j, t in enumerate(body.tokens) if not 0 <= t < vocab), None)
        if bad is not None:
            raise ApiError(400, f"tokens[{bad}]={body.tokens[bad]} is outside the vocabulary: token ids are "
                                f"0..{vocab - 1}", param="tokens")
        return {"prompt": tok.decode(body.tokens)}

    async def respond(request: Request, body, prompts: list, *, chat: bool, tools=None):
        call, renderer = handler.start(body, prompts, chat=chat, tools=tools, parser=tool_call_parser)
        if body.stream:
            return EngineStream(handler.stream(call, renderer, include_usage=body.include_usage),
                                media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        watch = asyncio.create_task(_on_disconnect(request, lambda: backend.end(call)))
        try:
            return await handler.collect(call, renderer)
        finally:
            watch.cancel()
            backend.end(call)

    mount_responses(app, handler, served_names, streaming=EngineStream, on_disconnect=_on_disconnect,
                    tool_call_parser=tool_call_parser)
    if admin is not None:
        mount_admin(app, admin)
    if api_key:
        app.add_middleware(ApiKey, key=api_key)
    return app


async def _on_disconnect(request: Request, then) -> None:
    """Wait for the client to go away (the body is already read), then call `then`."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            then()
            return
