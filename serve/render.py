"""OpenAI's response and stream-chunk bodies for completions and chat, built as plain dicts
(the hot path of 200 streams is json.dumps, not model validation).

Logprobs come from the engine's token payload, {"logprob": float, "top": [(id, logprob),
...]}; a token whose payload is None (an engine that computed none) renders as null. Prompt
logprobs come with a choice's first token, [None, {"token", "logprob", "rank", "top"}, ...],
and render as vLLM's `prompt_logprobs`: per prompt token None or {token id: {"logprob",
"rank", "decoded_token"}}, the prompt token first, then its likeliest alternatives; on each
completion choice (its first chunk when streaming), and for chat on the response (as vLLM)."""

from __future__ import annotations

import time
import uuid


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class Renderer:
    """Bodies for one response: its id, kind (completion or chat), model and creation time."""

    def __init__(self, *, chat: bool, model: str, tokenizer, token_ids: bool = False, echo: list[str] | None = None,
                 top: int | None = None, prompt_logprobs: int | None = None):
        """echo: each prompt's text, put before its choices' text (completions' echo); top: the
        alternatives asked per token; prompt_logprobs: the alternatives asked per prompt token
        (None: the prompt's logprobs are not rendered)."""
        self.chat, self.model, self.tokenizer, self.token_ids = chat, model, tokenizer, token_ids
        self.echo, self.top, self.prompt_logprobs = echo, top or 0, prompt_logprobs
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())
        self.tools = None  # with tools: a new tool parser per call (serve.tools.choice.ToolPlan.parser)
        self.parallel = True  # several calls in one choice allowed (parallel_tool_calls)

    def _head(self, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, choices: list[dict], use: dict) -> dict:
        out = {**self._head(False), "choices": choices, "usage": use}
        if self.chat and self.prompt_logprobs is not None:  # vLLM gives chat's on the response
            out["prompt_logprobs"] = choices[0].pop("prompt_logprobs", None) if choices else None
            for c in choices:
                c.pop("prompt_logprobs", None)
        return out

    def choice(self, index: int, text: str | None, finish_reason: str | None, *, tool_calls=None, ids=(),
               logprobs=None, prompt_ids=None, prompt: int = 0, prompt_logprobs=None) -> dict:
        """A whole choice (no streaming). tool_calls: the message's (OpenAI's entries), or
        None; logprobs: one payload per output token, or None; prompt: which prompt it answers
        (echo); prompt_logprobs: the engine's, or None."""
        out = {"index": index, "finish_reason": finish_reason}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
            if tool_calls:
                out["message"]["tool_calls"] = tool_calls
            out["logprobs"] = self.chat_logprobs(ids, logprobs) if logprobs is not None else None
        else:
            out["text"] = (self.echo[prompt] if self.echo else "") + text
            out["logprobs"] = self._completion(ids, logprobs, prompt_ids, prompt_logprobs, echo=bool(self.echo))
        if self.prompt_logprobs is not None:
            out["prompt_logprobs"] = self.prompt_logprobs_body(prompt_logprobs)
        if self.token_ids:
            out["token_ids"] = list(ids)
            out["prompt_token_ids"] = list(prompt_ids or [])
        return out

    def chunk(self, index: int, text: str | None, *, finish_reason: str | None = None, tool_calls=None, ids=(),
              logprobs=None, first: bool = False, prompt_ids=None, prompt: int = 0, prompt_logprobs=None) -> dict:
        """One stream chunk of one choice; the chat stream's first chunk names the role, and a
        choice's first chunk carries its echo and prompt logprobs; tool_calls: OpenAI's
        tool-call deltas."""
        c = {"index": index, "finish_reason": finish_reason}
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else {}
            if text and not first:
                delta["content"] = text
            if tool_calls:
                delta["tool_calls"] = tool_calls
            c["delta"] = delta
            c["logprobs"] = self.chat_logprobs(ids, logprobs) if logprobs is not None else None
        else:
            echo = bool(self.echo) and first
            c["text"] = (self.echo[prompt] if echo else "") + (text or "")
            c["logprobs"] = self._completion(ids, logprobs, prompt_ids, prompt_logprobs, echo=echo)
        if self.prompt_logprobs is not None and first:
            c["prompt_logprobs"] = self.prompt_logprobs_body(prompt_logprobs)
        if self.token_ids:
            c["token_ids"] = list(ids)
            if first:
                c["prompt_token_ids"] = list(prompt_ids or [])
        return {**self._head(True), "choices": [c]}

    def usage_chunk(self, use: dict) -> dict:
        return {**self._head(True), "choices": [], "usage": use}

    # --- logprobs ---

    def _text(self, token_id: int) -> str:
        if self.tokenizer is None:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _completion(self, ids, payloads, prompt_ids, prompt_logprobs, *, echo: bool) -> dict | None:
        """A completion choice's logprobs; with echo the prompt's come first (its first token's
        null, as OpenAI gives them), each with as many alternatives as asked."""
        if payloads is None:
            return None
        if not echo:
            return self.completion_logprobs(ids, payloads)
        if prompt_logprobs is None or len(prompt_logprobs) != len(prompt_ids or ()):
            return None  # the engine computed none
        head = [None] + [{"logprob": e["logprob"], "top": e["top"][:self.top]} for e in prompt_logprobs[1:]]
        return self.completion_logprobs(list(prompt_ids) + list(ids), head + list(payloads), leading_null=True)

    def completion_logprobs(self, ids, payloads, *, leading_null: bool = False) -> dict | None:
        """Completions' shape: parallel lists tokens, token_logprobs, top_logprobs, text_offset;
        leading_null: the first payload is an echoed prompt's first token, null."""
        if any(p is None for p in payloads[1 if leading_null else 0:]):
            return None
        tokens = [self._text(t) for t in ids]
        offsets, at = [], 0
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        return {"tokens": tokens, "token_logprobs": [p["logprob"] if p else None for p in payloads],
                "top_logprobs": [{self._text(t): lp for t, lp in p.get("top", ())} if p else None for p in payloads],
                "text_offset": offsets}

    def prompt_logprobs_body(self, entries) -> list | None:
        """vLLM's prompt_logprobs: per prompt token None or {token id: {logprob, rank,
        decoded_token}}, the prompt token first, then its likeliest alternatives."""
        if entries is None:
            return None
        out = []
        for e in entries:
            if e is None:
                out.append(None)
                continue
            one = {str(e["token"]): {"logprob": e["logprob"], "rank": e["rank"],
                                     "decoded_token": self._text(e["token"])}}
            for rank, (t, lp) in enumerate(e["top"][:self.prompt_logprobs], start=1):
                one.setdefault(str(t), {"logprob": lp, "rank": rank, "decoded_token": self._text(t)})
            out.append(one)
        return out

    def chat_logprobs(self, ids, payloads) -> dict | None:
        """Chat's shape: {"content": [{token, logprob, bytes, top_logprobs: [...]}, ...]}."""
        if any(p is None for p in payloads):
            return None
        content = []
        for t, p in zip(ids, payloads):
            tok = self._text(t)
            top = [{"token": (s := self._text(i)), "logprob": lp, "bytes": list(s.encode("utf-8"))}
                   for i, lp in p.get("top", ())]
            content.append({"token": tok, "logprob": p["logprob"], "bytes": list(tok.encode("utf-8")),
                            "top_logprobs": top})
        return {"content": content}
