"""SamplingParams: one request's sampling options, validated, with the defaults the CLI's
flags take too (vLLM's: max_tokens 16, greedy at temperature 0)."""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

from atoll.errors import InputError


MAX_LOGPROBS = 20  # the most alternatives a token's logprobs list (OpenAI's limit)


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
    # from the model's own distribution (before temperature, top-k and top-p), as vLLM gives them
    logprobs: int | None = None

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
        stop = self.stop
        if isinstance(stop, str) or not isinstance(stop, (list, tuple)):
            if not isinstance(stop, str) or not stop:
                raise InputError(f"stop={_short(stop)} must be a non-empty string or a list of them")
            stop = (stop,)
        for j, s in enumerate(stop):
            if not isinstance(s, str) or not s:
                raise InputError(f"stop[{j}]={_short(s)} must be a non-empty string")
        object.__setattr__(self, "stop", tuple(stop))
        ids = tuple(self.stop_token_ids)
        if not all(isinstance(t, numbers.Integral) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise InputError(f"stop_token_ids={_short(self.stop_token_ids)} must be token ids (whole numbers >= 0)")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in ids))
        if not isinstance(self.ignore_eos, bool):
            raise InputError(f"ignore_eos={_short(self.ignore_eos)} must be true or false")
        if self.logprobs is not None:
            _whole(self, "logprobs", low=0, high=MAX_LOGPROBS)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


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
