"""Tokenizer over the `tokenizers` library, with the checkpoint's chat template (Jinja)."""

from __future__ import annotations

import json
from pathlib import Path

from atoll.errors import CheckpointError


def _token_text(tok) -> str | None:
    return tok.get("content") if isinstance(tok, dict) else tok


class Tokenizer:
    def __init__(self, directory: str | Path):
        from tokenizers import Tokenizer as HFTokenizer

        d = Path(directory)
        path = d / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"no tokenizer.json in {d}; pass prompt_token_ids instead of text")
        self._tok = HFTokenizer.from_file(str(path))
        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text()) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        if template is None and (d / "chat_template.jinja").exists():
            template = (d / "chat_template.jinja").read_text()
        self.chat_template = template
        self.bos_token = _token_text(cfg.get("bos_token"))
        self.eos_token = _token_text(cfg.get("eos_token"))
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True) -> str:
        if not self.chat_template:
            raise CheckpointError("this tokenizer has no chat template")
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message):
            raise CheckpointError(f"chat template: {message}")

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        return env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "")

    def encode_chat(self, text: str) -> list[int]:
        """A user message through the chat template; the template already holds any BOS."""
        return self.encode(self.apply_chat_template([{"role": "user", "content": text}]),
                           add_special_tokens=False)
