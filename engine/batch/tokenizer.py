"""Tokenizer over the `tokenizers` library, with the checkpoint's chat template (Jinja)."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path

from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from atoll.errors import CheckpointError
from atoll.models.jsonfile import first_line as _first_line, read_json_object


def _token_text(tok, path: Path, key: str) -> str | None:
    text = tok.get("content") if isinstance(tok, dict) else tok
    if text is not None and not isinstance(text, str):
        raise CheckpointError(f"{path}: {key}={tok!r} must be a token string or "
                              '{"content": "..."}')
    return text


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


class Tokenizer:
    def __init__(self, directory: str | Path):
        d = self.dir = Path(directory)
        path = d / "tokenizer.json"
        if not path.exists():
            raise CheckpointError(f"no tokenizer.json in {d}; pass prompt_token_ids instead of text")
        if not path.is_file():
            raise CheckpointError(f"{path} is a directory, not a tokenizer file")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # tokenizers raises a bare Exception for a bad file
            raise CheckpointError(f"{path} is not a valid tokenizers file: {_first_line(e)}") from None
        cfg_path = d / "tokenizer_config.json"
        cfg = read_json_object(cfg_path) if cfg_path.exists() else {}
        template = cfg.get("chat_template")
        jinja = d / "chat_template.jinja"
        if template is None and jinja.exists():
            try:
                template = jinja.read_text()
            except (OSError, UnicodeDecodeError) as e:
                raise CheckpointError(f"cannot read {jinja}: {_first_line(e)}") from None
        if isinstance(template, list):  # [{"name": "default", "template": "..."}, ...]
            named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
            template = named.get("default")
        if template is not None and not isinstance(template, str):
            raise CheckpointError(f"{cfg_path}: chat_template must be a string")
        self.chat_template = template
        self.bos_token = _token_text(cfg.get("bos_token"), cfg_path, "bos_token")
        self.eos_token = _token_text(cfg.get("eos_token"), cfg_path, "eos_token")
        self.eos_token_id = self._tok.token_to_id(self.eos_token) if self.eos_token else None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size()

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def token_strings(self, ids: list[int]) -> list[str]:
        """Each id's token as the vocabulary spells it (byte-level BPE's "Ġ" and all), as
        transformers' convert_ids_to_tokens gives them."""
        return [self._tok.id_to_token(i) or "" for i in ids]

    def decode(self, ids: list[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            continue_final_message: bool = False, tools: list[dict] | None = None) -> str:
        """The template's text; continue_final_message: the last message left open (the text
        ends with its content, as transformers cuts it), for the model to go on with; tools:
        the tools' JSON schemas ({"type": "function", "function": {...}}), as transformers'
        `tools=` hands them to the template."""
        text = self._render(messages, add_generation_prompt=add_generation_prompt and not continue_final_message,
                            tools=tools)
        if continue_final_message:
            last = (messages[-1].get("content") or "").strip() if messages else ""
            at = text.rfind(last) if last else -1
            if at < 0:
                raise CheckpointError("continue_final_message: the last message's content is not in the "
                                      "template's text")
            text = text[:at + len(last)]
        return text

    def _render(self, messages: list[dict], *, add_generation_prompt: bool, tools: list[dict] | None) -> str:
        if not self.chat_template:
            raise CheckpointError("this tokenizer has no chat template")

        def raise_exception(message):
            raise CheckpointError(f"chat template: {message}")

        # the environment transformers renders templates in: its tojson (no HTML escaping, as
        # tool schemas need), strftime_now and loop controls
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
        env.globals["raise_exception"] = raise_exception
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        env.filters["tojson"] = _tojson
        try:
            return env.from_string(self.chat_template).render(
                messages=messages, tools=tools, add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "")
        except TemplateError as e:
            raise CheckpointError(f"the chat template in {self.dir} is broken: {_first_line(e)}") from None

    def encode_chat(self, text: str) -> list[int]:
        """A user message through the chat template; the template already holds any BOS."""
        return self.encode(self.apply_chat_template([{"role": "user", "content": text}]),
                           add_special_tokens=False)
