"""SamplingParams: one request's sampling options, validated, with the defaults the CLI's
flags take too (vLLM's: max_tokens 16, greedy at temperature 0).

Names and meanings are OpenAI's and vLLM's, so a request moves between servers unchanged:
`presence_penalty` and `frequency_penalty` (OpenAI: subtracted for each generated token that
appeared, once or per occurrence), vLLM's `repetition_penalty` (over the prompt's and the
generated tokens: positive logits divided, negative ones multiplied), `logit_bias` (token id
-> a bias added, -100..100), `min_tokens` (the stop tokens are masked until that many are
out), `bad_words` (vLLM: a word's last token is masked where the tokens before it were just
generated), `prompt_logprobs` and `n` (copies of the request, each its own seed stream). What
they do to the logits is engine/sample/processors.py. `structured_outputs` (vLLM's) constrains
the output to a JSON schema, regex, choice or grammar (engine/sample/grammar.py)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from atoll.config.structured import StructuredOutputs
from atoll.errors import InputError


MAX_LOGPROBS = 20  # the most alternatives a token's logprobs list (OpenAI's limit)
MAX_N = 128  # the most copies one request asks for (OpenAI's limit)
MAX_BIAS = 100.0  # logit_bias values lie in [-MAX_BIAS, MAX_BIAS] (OpenAI's range)
MAX_BAD_WORDS = 128  # bad words of one request, after tokenizing (vLLM's default limit)


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 means no top-k cut
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    stop: tuple[str, ...] = ()
    ignore_eos: bool = False
    # log-probabilities of each sampled token and of the `logprobs` likeliest ones (None: none),
    # from the model's own distribution (before penalties, temperature, top-k and top-p), as
    # vLLM gives them by default (its logprobs_mode raw_logprobs)
    logprobs: int | None = None
    n: int = 1  # copies of the request; copy i samples with seed + i (engine.batch.copies)
    presence_penalty: float = 0.0  # [-2, 2]
    frequency_penalty: float = 0.0  # [-2, 2]
    repetition_penalty: float = 1.0  # > 0; 1 means none
    logit_bias: dict | None = None  # token id -> bias in [-100, 100]
    min_tokens: int = 0  # stop tokens (and EOS unless ignore_eos) masked until this many are out
    bad_words: tuple[str, ...] = ()  # words (text) that may not be generated; tokenized by LLM.prepare
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()  # the same as token id sequences
    prompt_logprobs: int | None = None  # log-probabilities of each prompt token and its likeliest ones
    # what the output must match (a JSON schema, regex, choice, grammar): config/structured.py
    structured_outputs: StructuredOutputs | None = None

    def __post_init__(self):
        # every message starts with `field=value`, so the CLI can name its flag instead
        _whole(self, "max_tokens", low=1)
        _real(self, "temperature")
        if self.temperature < 0:
            raise InputError(f"temperature={self.temperature} must be >= 0 (0 means greedy)")
        _real(self, "top_p")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p={self.top_p} must be in (0, 1]")
        _whole(self, "top_k", low=0)
        if self.seed is not None:
            _whole(self, "seed", low=0, high=2**64 - 1)  # what torch.Generator.manual_seed takes
        object.__setattr__(self, "stop", _texts(self.stop, "stop"))
        object.__setattr__(self, "stop_token_ids", _ids(self.stop_token_ids, "stop_token_ids"))
        if not isinstance(self.ignore_eos, bool):
            raise InputError(f"ignore_eos={_short(self.ignore_eos)} must be true or false")
        if self.logprobs is not None:
            _whole(self, "logprobs", low=0, high=MAX_LOGPROBS)
        if self.prompt_logprobs is not None:
            _whole(self, "prompt_logprobs", low=0, high=MAX_LOGPROBS)
        _whole(self, "n", low=1, high=MAX_N)
        if self.n > 1 and self.greedy:  # vLLM's rule: greedy copies would all be the same
            raise InputError(f"n={self.n} needs temperature > 0: greedy copies would all be the same")
        for name in ("presence_penalty", "frequency_penalty"):
            _real(self, name)
            if not -2 <= getattr(self, name) <= 2:
                raise InputError(f"{name}={getattr(self, name)} must be in [-2, 2]")
        _real(self, "repetition_penalty")
        if self.repetition_penalty <= 0:
            raise InputError(f"repetition_penalty={self.repetition_penalty} must be greater than 0 (1 means none)")
        object.__setattr__(self, "logit_bias", _bias(self.logit_bias))
        _whole(self, "min_tokens", low=0)
        if self.min_tokens > self.max_tokens:
            raise InputError(f"min_tokens={self.min_tokens} must be at most max_tokens={self.max_tokens}")
        object.__setattr__(self, "bad_words", _texts(self.bad_words, "bad_words"))
        words = self.bad_words_token_ids
        if not isinstance(words, (list, tuple)):
            raise InputError(f"bad_words_token_ids={_short(words)} must be a list of token id lists")
        words = tuple(_ids(w, f"bad_words_token_ids[{j}]", empty=False) for j, w in enumerate(words))
        if len(words) > MAX_BAD_WORDS:
            raise InputError(f"bad_words_token_ids holds {len(words)} words; at most {MAX_BAD_WORDS}")
        object.__setattr__(self, "bad_words_token_ids", words)
        object.__setattr__(self, "structured_outputs", StructuredOutputs.of(self.structured_outputs))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def processed(self) -> bool:
        """Whether anything changes the logits before a token is drawn (engine.sample.processors)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1
                    or self.logit_bias or self.min_tokens or self.bad_words_token_ids)


def _short(value) -> str:
    text = repr(value)  # repr escapes lone surrogates: the message stays writable
    return text if len(text) <= 40 else text[:37] + "..."


def _whole(params, name: str, *, low: int, high: int | None = None) -> None:
    v = getattr(params, name)
    if isinstance(v, bool) or not isinstance(v, numbers.Integral):
        raise InputError(f"{name}={_short(v)} must be a whole number")
    if v < low or (high is not None and v > high):
        bound = f"at least {low}" if high is None else f"between {low} and {high}"
        raise InputError(f"{name}={v} must be {bound}")
    object.__setattr__(params, name, int(v))


def _real(params, name: str) -> None:
    v = getattr(params, name)
    if isinstance(v, bool) or not isinstance(v, numbers.Real) or not math.isfinite(v):
        raise InputError(f"{name}={_short(v)} must be a finite number")
    object.__setattr__(params, name, float(v))


def _is_id(t) -> bool:
    return isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0


def _ids(ids, name: str, *, empty: bool = True) -> tuple[int, ...]:
    if isinstance(ids, (str, bytes)) or not isinstance(ids, (list, tuple)) or not all(_is_id(t) for t in ids) \
            or (not ids and not empty):
        raise InputError(f"{name}={_short(ids)} must be a {'' if empty else 'non-empty '}list of token ids "
                         "(whole numbers >= 0)")
    return tuple(int(t) for t in ids)


def _texts(value, name: str) -> tuple[str, ...]:
    """A string or a list of non-empty strings, as a tuple."""
    if isinstance(value, str) or not isinstance(value, (list, tuple)):
        if not isinstance(value, str) or not value:
            raise InputError(f"{name}={_short(value)} must be a non-empty string or a list of them")
        value = (value,)
    for j, s in enumerate(value):
        if not isinstance(s, str) or not s:
            raise InputError(f"{name}[{j}]={_short(s)} must be a non-empty string")
    return tuple(value)


def _bias(bias) -> dict | None:
    """logit_bias as {token id: float}: keys whole numbers (or their decimal text, as JSON
    gives them), values in [-100, 100]. The vocabulary is checked by LLM.prepare."""
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        raise InputError(f"logit_bias={_short(bias)} must be a map of token id -> bias")
    out = {}
    for key, value in bias.items():
        token = int(key) if isinstance(key, str) and key.strip().isdigit() else key
        if not _is_id(token):
            raise InputError(f"logit_bias={_short(bias)}: key {key!r} is not a token id (a whole number >= 0)")
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) \
                or not -MAX_BIAS <= value <= MAX_BIAS:
            raise InputError(f"logit_bias={_short(bias)}: the bias of token {token} is {_short(value)}; each "
                             f"must be a number in [-{MAX_BIAS:g}, {MAX_BIAS:g}]")
        out[int(token)] = float(value)
    return out
