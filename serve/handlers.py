"""A completion or chat request from its validated body to the engine and back: sampling
params and token budget, then the whole response (collect) or its stream of chunks. A prompt
of n > 1 is n choices side by side (Backend.start); `echo` puts the prompt before a completion's
text (and its logprobs before the output's); prompt logprobs come with a choice's first token."""

from __future__ import annotations

import json
import time
from dataclasses import replace

from atoll.engine.driver.token_params import token_params
from atoll.errors import InputError
from atoll.serve.backend import Backend, Call
from atoll.serve.protocol import ApiError, sampling_params
from atoll.serve.render import Renderer, usage
from atoll.serve.stream import TextStream, sse

COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions; chat's is the context left


def dumps(body: dict) -> str:
    return json.dumps(body, ensure_ascii=False, separators=(",", ":"))


class Handler:
    def __init__(self, backend: Backend, *, model: str):
        self.backend, self.llm, self.model = backend, backend.llm, model

    def start(self, body, prompts: list, *, chat: bool, tools=None, parser: str | None = None) -> tuple[Call, Renderer]:
        """Validate, tokenize and submit: the call in the engine and its renderer. tools: the
        request's ToolPlan (serve.tools.choice), whose grammar (if any) constrains the output;
        parser: the server's --tool-call-parser."""
        arrived = time.monotonic()  # the latencies include tokenizing
        param = "messages" if chat else "prompt"
        limit = body.token_limit if chat else body.max_tokens
        logprobs = body.num_logprobs if chat else body.logprobs
        if body.stop and self.llm.tokenizer is None:
            raise ApiError(400, "stop strings need the model's tokenizer.json, which it lacks", param="stop")
        self.backend.check_admission(len(prompts) * body.n)  # before tokenizing: a full queue answers at once
        params = sampling_params(body, max_tokens=limit or max(1, body.min_tokens), logprobs=logprobs)
        forced = tools.structured() if tools is not None else None
        if forced is not None:
            if params.structured_outputs is not None:
                raise ApiError(400, f"{params.structured_outputs.field} and tool_choice={tools.mode!r} both constrain "
                                    "the output: give one", param=params.structured_outputs.field)
            params = replace(params, structured_outputs=forced)
        params = self._checked(params)
        limit_param = "max_completion_tokens" if chat and body.max_completion_tokens is not None else "max_tokens"
        requests = [self._budget(r, limit, chat=chat, param=param, limit_param=limit_param)
                    for r in self.backend.prepare(prompts, params, param=param)]
        call = self.backend.start(requests, arrived=arrived)
        call.logprobs = logprobs is not None
        echo = None
        if not chat and getattr(body, "echo", False):
            tok = self.llm.tokenizer
            echo = [p if isinstance(p, str) else tok.decode(p) if tok is not None else "" for p in prompts]
        renderer = Renderer(chat=chat, model=body.model or self.model, tokenizer=self.llm.tokenizer,
                            token_ids=body.return_token_ids, echo=echo, top=logprobs,
                            prompt_logprobs=body.prompt_logprobs)
        if tools is not None and tools.mode != "none":
            renderer.tools = lambda: tools.parser(parser)
            renderer.parallel = tools.parallel
        return call, renderer

    def _checked(self, params):
        """Token ids against the vocabulary, bad words tokenized: a 400 naming the field."""
        try:
            return token_params(params, vocab_size=self.llm.config.vocab_size, tokenizer=self.llm.tokenizer,
                                model_dir=self.llm.model_dir, grammars=self.llm.grammars)
        except InputError as e:  # its messages start with `field:`
            raise ApiError(400, str(e), param=str(e).partition(":")[0]) from None

    def _budget(self, req, limit: int | None, *, chat: bool, param: str, limit_param: str):
        """max_tokens within the context: given and too many, a 400; not given, chat gets the
        context left and completions OpenAI's 16 (or less, where less is left)."""
        room = self.llm.max_model_len - len(req.prompt_token_ids)
        if limit is not None and limit > room:
            raise ApiError(400, f"{limit_param}={limit}: the {param} has {len(req.prompt_token_ids)} tokens and the "
                                f"context is {self.llm.max_model_len} (max_model_len), room for {room} new tokens",
                           param=limit_param, code="context_length_exceeded")
        tokens = limit if limit is not None else room if chat else min(COMPLETION_MAX_TOKENS, room)
        if req.params.min_tokens > tokens:
            raise ApiError(400, f"min_tokens={req.params.min_tokens} is more than the {tokens} tokens this request "
                                "may generate", param="min_tokens")
        return replace(req, params=replace(req.params, max_tokens=tokens))

    def _finish(self, call: Call, choice: int, result: dict):
        return self.llm.finish([None], [call.requests[choice]], [result])[0]

    def _usage(self, call: Call, results: dict) -> dict:
        """Prompt and cached tokens once per prompt (its first copy's), as OpenAI counts them."""
        firsts = range(0, len(call.requests), call.n)
        return usage(sum(len(call.requests[k].prompt_token_ids) for k in firsts),
                     sum(len(res["token_ids"]) for res in results.values()),
                     sum(results[k]["metrics"].get("cached_tokens", 0) or 0 for k in firsts if k in results))

    async def collect(self, call: Call, renderer: Renderer) -> dict:
        """Wait for every choice; the whole response."""
        n = len(call.requests)
        results: dict[int, dict] = {}
        payloads: dict[int, list] = {k: [] for k in range(n)}
        prompts: dict[int, list] = {}
        while len(results) < n:
            for choice, kind, payload, _ in await call.events.batch():
                if kind == "token":
                    payloads[choice].append(payload[1])
                    if len(payload) > 2 and payload[2] is not None:
                        prompts[choice] = payload[2]
                elif kind == "finish":
                    results[choice] = payload
                else:
                    raise _failure(choice, payload)
        choices = []
        for k in range(n):
            out = self._finish(call, k, results[k])
            text, calls, reason = out.text or "", None, out.finish_reason
            if renderer.tools is not None:
                text, calls = renderer.tools().extract(text)
                calls = [c.body() for c in calls[:None if renderer.parallel else 1]]
                reason = "tool_calls" if calls and reason == "stop" else reason
            choices.append(renderer.choice(k, text, reason, tool_calls=calls, ids=out.token_ids,
                                           logprobs=payloads[k] if call.logprobs else None,
                                           prompt_ids=call.requests[k].prompt_token_ids, prompt=k // call.n,
                                           prompt_logprobs=prompts.get(k, results[k].get("prompt_logprobs"))))
        return renderer.response(choices, self._usage(call, results))

    async def stream(self, call: Call, renderer: Renderer, *, include_usage: bool):
        """Server-sent events: chunks as tokens come, [DONE] at the end. However it ends (a
        client gone included), the call's unfinished engine requests are aborted."""
        n = len(call.requests)
        texts = [TextStream(self.llm.tokenizer, r.params.stop, min_tokens=r.params.min_tokens)
                 for r in call.requests]
        results: dict[int, dict] = {}
        prompts: dict[int, list] = {}
        started: set[int] = set()
        parsers = [renderer.tools() if renderer.tools is not None else None for _ in call.requests]
        try:
            while len(results) < n:
                batch = await call.events.batch()
                ids: dict[int, list] = {}
                lps: dict[int, list] = {}
                ended: list[int] = []
                for choice, kind, payload, _ in batch:
                    if kind == "token":
                        ids.setdefault(choice, []).append(payload[0])
                        lps.setdefault(choice, []).append(payload[1])
                        if len(payload) > 2 and payload[2] is not None:
                            prompts[choice] = payload[2]
                    elif kind == "finish":
                        results[choice] = payload
                        ended.append(choice)
                    else:
                        yield sse(dumps(_failure(choice, payload).body()))
                        yield sse("[DONE]")
                        return
                for choice in sorted(set(ids) | set(ended)):
                    new = ids.get(choice, [])
                    text = texts[choice].push(new)
                    reason = None
                    if choice in results:
                        out = self._finish(call, choice, results[choice])
                        text += texts[choice].finish(out.text)
                        reason = out.finish_reason
                    calls = None
                    if parsers[choice] is not None:
                        text, calls, reason = _tool_deltas(parsers[choice], text, reason, renderer.parallel)
                    first = choice not in started
                    if not (text or first or reason or calls or (call.logprobs and new) or (renderer.token_ids and new)):
                        continue
                    started.add(choice)
                    yield sse(dumps(renderer.chunk(choice, text, finish_reason=reason, tool_calls=calls, ids=new,
                                                   logprobs=lps.get(choice, []) if call.logprobs else None,
                                                   first=first, prompt_ids=call.requests[choice].prompt_token_ids,
                                                   prompt=choice // call.n, prompt_logprobs=prompts.get(choice))))
            if include_usage:
                yield sse(dumps(renderer.usage_chunk(self._usage(call, results))))
            yield sse("[DONE]")
        finally:
            self.backend.end(call)


def _tool_deltas(parser, text: str, reason: str | None, parallel: bool) -> tuple[str, list | None, str | None]:
    """A choice's new text through its tool parser: (content, tool-call deltas, finish_reason);
    at the end, what the parser held back too, and "tool_calls" where it called one."""
    content, calls = parser.feed(text)
    if reason is not None:
        more, last = parser.finish()
        content, calls = content + more, calls + last
        reason = "tool_calls" if parser.called and reason == "stop" else reason
    calls = [c for c in calls if parallel or c["index"] == 0]
    return content, calls or None, reason


def _failure(choice, line: str) -> ApiError:
    """An error event: the engine failed (naming the rank), or the server shut down first."""
    if choice is None:
        e = ApiError(503, line, type="server_error", code="shutting_down")
    else:
        e = ApiError(500, f"the engine failed: {line}", type="server_error", code="engine_error")
    e.counted = True  # the Backend counted it as it happened
    return e
