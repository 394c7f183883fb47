"""OpenAI's response and stream-chunk bodies for completions and chat, built as plain dicts
(the hot path of 200 streams is json.dumps, not model validation).

Logprobs come from the engine's token payload, {"logprob": float, "top": [(id, logprob),
...]}; a token whose payload is None (an engine that computed none) renders as null."""

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

    def __init__(self, *, chat: bool, model: str, tokenizer, token_ids: bool = False):
        self.chat, self.model, self.tokenizer, self.token_ids = chat, model, tokenizer, token_ids
        self.id = new_id("chatcmpl" if chat else "cmpl")
        self.created = int(time.time())

    def _head(self, chunk: bool) -> dict:
        obj = ("chat.completion.chunk" if chunk else "chat.completion") if self.chat else "text_completion"
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def response(self, choices: list[dict], use: dict) -> dict:
        return {**self._head(False), "choices": choices, "usage": use}

    def choice(self, index: int, text: str, finish_reason: str | None, *, ids=(), logprobs=None,
               prompt_ids=None) -> dict:
        """A whole choice (no streaming). logprobs: one payload per output token, or None."""
        out = {"index": index, "finish_reason": finish_reason}
        if self.chat:
            out["message"] = {"role": "assistant", "content": text}
            out["logprobs"] = self.chat_logprobs(ids, logprobs) if logprobs is not None else None
        else:
            out["text"] = text
            out["logprobs"] = self.completion_logprobs(ids, logprobs) if logprobs is not None else None
        if self.token_ids:
            out["token_ids"] = list(ids)
            out["prompt_token_ids"] = list(prompt_ids or [])
        return out

    def chunk(self, index: int, text: str | None, *, finish_reason: str | None = None, ids=(), logprobs=None,
              first: bool = False, prompt_ids=None) -> dict:
        """One stream chunk of one choice; the chat stream's first chunk names the role."""
        c = {"index": index, "finish_reason": finish_reason}
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else {}
            if text and not first:
                delta["content"] = text
            c["delta"] = delta
            c["logprobs"] = self.chat_logprobs(ids, logprobs) if logprobs is not None else None
        else:
            c["text"] = text or ""
            c["logprobs"] = self.completion_logprobs(ids, logprobs) if logprobs is not None else None
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

    def completion_logprobs(self, ids, payloads) -> dict | None:
        """Completions' shape: parallel lists tokens, token_logprobs, top_logprobs, text_offset."""
        if any(p is None for p in payloads):
            return None
        tokens = [self._text(t) for t in ids]
        offsets, at = [], 0
        for tok in tokens:
            offsets.append(at)
            at += len(tok)
        return {"tokens": tokens, "token_logprobs": [p["logprob"] for p in payloads],
                "top_logprobs": [{self._text(t): lp for t, lp in p.get("top", ())} for p in payloads],
                "text_offset": offsets}

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
