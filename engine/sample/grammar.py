"""Grammars for structured outputs, through llguidance: a request's StructuredOutputs
(config/structured.py) compiled against the model's tokenizer into a matcher, which gives the
bitmask of the tokens allowed next and follows the tokens the sequence takes.

- Grammars: one per process that needs them (the driver checks each request's grammar, the
  sampling rank makes the matchers). It holds llguidance's tokenizer, made on first use from
  tokenizer.json (about 0.3 s for a 49k vocabulary), and the compiled grammars: an LRU of
  MAX_CACHED matchers keyed by StructuredOutputs.key (kind, canonical text, whitespace
  pattern), each request taking a copy of its cached one (deep_copy: microseconds).
- GrammarState: one sequence's matcher and how many of its output tokens it has consumed; it
  catches up with the output before each mask (the tokens a step took are known to every
  rank when the next step is scheduled).

A JSON schema compiles to JSON as json.dumps prints it (", " and ": " between items, no other
whitespace), unless the request gives its own whitespace_pattern."""

from __future__ import annotations

import os
import time
from collections import OrderedDict
from pathlib import Path

import llguidance

from atoll.errors import InputError

MAX_CACHED = 256  # compiled grammars a process keeps (least recently used first out)
JSON_DEFAULTS = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


def grammar_text(so) -> str:
    """The llguidance grammar of a StructuredOutputs (not yet checked)."""
    kind = so.kind
    if kind in ("json", "json_object"):
        options = dict(JSON_DEFAULTS)
        if so.whitespace_pattern is not None:
            options = {"whitespace_pattern": so.whitespace_pattern, "whitespace_flexible": True}
        schema = so.json if kind == "json" else {"type": "object"}
        try:
            return llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        except ValueError as e:
            raise InputError(f"{so.field}: {_one_line(e)}") from None
    if kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(so.regex)
    if kind == "choice":
        return llguidance.grammar_from("choice", list(so.choice))
    try:
        return llguidance.grammar_from("grammar", so.grammar)  # Lark, or GBNF/EBNF converted to Lark
    except ValueError as e:
        raise InputError(f"{so.field}: {_one_line(e)}") from None


class Grammars:
    """The compiled grammars of one model's tokenizer. eos: the token the grammar allows once
    it is complete (any of the request's stop tokens is then allowed too: allowed_rows)."""

    def __init__(self, model_dir, vocab_size: int, eos: int | None):
        self.model_dir, self.vocab_size, self.eos = Path(model_dir), vocab_size, eos
        self._tokenizer = None
        self._executor = None
        self._cache: OrderedDict = OrderedDict()
        # fill masks on llguidance's threads: only where cores are many (on a small host its
        # spinning threads would take cores from the forward)
        self.parallel = (os.cpu_count() or 1) >= 8
        self.compiled = 0  # grammars compiled (cache misses)
        self.compile_s = 0.0  # seconds spent compiling them
        self.masks, self.mask_s = 0, 0.0  # micro-batches' masks filled, and the seconds the fills took
        self.waited_s = 0.0  # seconds sampling waited for a fill (what the forward did not hide)

    @property
    def tokenizer(self) -> "llguidance.LLTokenizer":
        if self._tokenizer is None:
            path = self.model_dir / "tokenizer.json"
            if not path.is_file():
                raise InputError(f"structured_outputs: {self.model_dir} has no tokenizer.json, which grammars need")
            # n_vocab: the model's logits width (past the tokenizer's own ids every bit is off)
            self._tokenizer = llguidance.LLTokenizer(path.read_text(encoding="utf-8"), n_vocab=self.vocab_size,
                                                     eos_token=self.eos)
        return self._tokenizer

    @property
    def executor(self) -> "llguidance.LLExecutor":
        """llguidance's threads, which fill a micro-batch's masks in parallel without the GIL."""
        if self._executor is None:  # half the host's cores at most: the forward has the others
            self._executor = llguidance.LLExecutor(num_threads=max(1, min(16, (os.cpu_count() or 2) // 2)))
        return self._executor

    @property
    def words(self) -> int:
        """int32 words in one row of a bitmask."""
        return (self.vocab_size + 31) // 32

    def compiled_matcher(self, so, *, field: str | None = None) -> "llguidance.LLMatcher":
        """The cached compiled grammar of `so` (compiled on a miss); InputError naming the
        field (`field`, or so.field) when the schema, regex or grammar is invalid."""
        key = so.key
        hit = self._cache.get(key)
        if hit is not None:
            self._cache.move_to_end(key)
            return hit
        name = field or so.field
        t0 = time.perf_counter()
        try:
            text = grammar_text(so)
        except InputError as e:
            raise InputError(f"{name}: {str(e).partition(': ')[2]}") from None
        matcher = llguidance.LLMatcher(self.tokenizer, text, log_level=0)
        if matcher.is_error():
            raise InputError(f"{name}: invalid {so.kind.replace('_', ' ')}: {_one_line(matcher.get_error())}")
        self.compile_s += time.perf_counter() - t0
        self.compiled += 1
        self._cache[key] = matcher
        while len(self._cache) > MAX_CACHED:
            self._cache.popitem(last=False)
        return matcher

    def check(self, so, *, field: str | None = None) -> None:
        """Compiles (or finds) the grammar: InputError naming the field if it is invalid."""
        self.compiled_matcher(so, field=field)

    def state(self, so) -> "GrammarState":
        """A new sequence's matcher, a copy of the cached compiled one."""
        return GrammarState(self.compiled_matcher(so).deep_copy())


class GrammarState:
    """One sequence's matcher and the output tokens it has consumed."""

    def __init__(self, matcher):
        self.matcher = matcher
        self.consumed = 0

    def catch_up(self, output: list[int]) -> None:
        """Consumes the output's tokens since the last call. A token the grammar refuses (a
        stop token taken once the grammar is complete, say) leaves the matcher stopped."""
        if len(output) > self.consumed:
            self.matcher.consume_tokens(output[self.consumed:])
            self.consumed = len(output)


def _one_line(e) -> str:
    """llguidance's (often multi-line, caret-pointing) message as one line."""
    lines = [ln.strip() for ln in str(e).splitlines()]
    text = " ".join(ln for ln in lines if ln and set(ln) - set("^ ") and not ln[:1].isdigit() and ln[:1] != "|")
    text = text or " ".join(ln for ln in lines if ln)
    return text if len(text) <= 300 else text[:297] + "..."
