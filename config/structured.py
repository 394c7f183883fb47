"""StructuredOutputs: what a request's output must match, in vLLM's names (its
`structured_outputs` object, since v0.12; the older `guided_json`, `guided_regex`,
`guided_choice` and `guided_grammar` are the same fields): exactly one of `json` (a JSON
schema), `regex`, `choice` (a list of strings), `grammar` (Lark, or GBNF/EBNF) or
`json_object` (any JSON object); `whitespace_pattern` (a regex) sets the whitespace a JSON
output may hold between its tokens.

This file only checks shapes; the grammar itself is compiled (and a bad one refused, naming
the field) against the model's tokenizer by engine/sample/grammar.py, which also caches the
compiled grammars by `key`."""

from __future__ import annotations

import json
from dataclasses import dataclass

from atoll.errors import InputError

KINDS = ("json", "regex", "choice", "grammar", "json_object")
MAX_GRAMMAR_CHARS = 1_000_000  # a schema or grammar's text beyond this is refused before compiling


@dataclass(frozen=True)
class StructuredOutputs:
    json: object = None  # a JSON schema: a dict, or its JSON text
    regex: str | None = None
    choice: tuple[str, ...] | None = None
    grammar: str | None = None
    json_object: bool = False
    whitespace_pattern: str | None = None
    source: str | None = None  # the request field it came from, which a refusal names

    def __post_init__(self):
        given = [k for k in KINDS if (getattr(self, k) not in (None, False))]
        if len(given) != 1:
            named = ", ".join(given) if given else "none"
            raise InputError(f"structured_outputs={{{named}}}: give exactly one of json, regex, choice, grammar "
                             "or json_object")
        if not isinstance(self.json_object, bool):
            raise InputError(f"structured_outputs.json_object={self.json_object!r} must be true or false")
        if self.json is not None:
            schema = self.json
            if isinstance(schema, str):
                try:
                    schema = json.loads(schema)
                except ValueError as e:
                    raise InputError(f"structured_outputs.json: not valid JSON: {e}") from None
            if not isinstance(schema, (dict, bool)):
                raise InputError(f"structured_outputs.json={_short(schema)} must be a JSON schema (an object)")
            object.__setattr__(self, "json", schema)
        for name in ("regex", "grammar", "whitespace_pattern"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, str) or not v):
                raise InputError(f"structured_outputs.{name}={_short(v)} must be a non-empty string")
        if self.choice is not None:
            c = self.choice
            if isinstance(c, str) or not isinstance(c, (list, tuple)) or not c \
                    or not all(isinstance(s, str) and s for s in c):
                raise InputError(f"structured_outputs.choice={_short(c)} must be a non-empty list of non-empty "
                                 "strings")
            object.__setattr__(self, "choice", tuple(c))
        if len(self.key[1]) > MAX_GRAMMAR_CHARS:
            raise InputError(f"structured_outputs.{self.kind} holds {len(self.key[1])} characters; at most "
                             f"{MAX_GRAMMAR_CHARS}")

    @classmethod
    def of(cls, value) -> "StructuredOutputs | None":
        """From a StructuredOutputs, a dict of its fields (a request line, vLLM's body), or None."""
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise InputError(f"structured_outputs={_short(value)} must be an object with one of json, regex, "
                             "choice, grammar or json_object")
        unknown = sorted(set(value) - set(KINDS) - {"whitespace_pattern"})
        if unknown:
            raise InputError(f"structured_outputs.{unknown[0]} is not supported by atoll (it takes json, regex, "
                             "choice, grammar, json_object and whitespace_pattern)")
        return cls(**value)

    @property
    def kind(self) -> str:
        return next(k for k in KINDS if getattr(self, k) not in (None, False))

    @property
    def field(self) -> str:
        """The field a refusal names."""
        return self.source or f"structured_outputs.{self.kind}"

    @property
    def key(self) -> tuple[str, str, str | None]:
        """What a compiled grammar is cached by: the kind, its text (a schema as canonical JSON:
        sorted keys, no spaces, so the same schema sent twice hits) and the whitespace pattern."""
        kind, v = self.kind, getattr(self, self.kind)
        if kind == "json":
            text = json.dumps(v, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        elif kind == "choice":
            text = json.dumps(list(v), ensure_ascii=False)
        elif kind == "json_object":
            text = ""
        else:
            text = v
        return kind, text, self.whitespace_pattern


def _short(value) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
