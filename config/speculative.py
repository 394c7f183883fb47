"""SpeculativeConfig: speculative decoding's options, spelled as vLLM's `--speculative-config`
JSON so a vLLM user's settings carry over.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
    {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 8}
    {"model": "/path/to/draft", "num_speculative_tokens": 4}
    {"method": "deepseek_mtp", "num_speculative_tokens": 2}
    {"method": "lookahead", "window": 5, "ngram": 4, "guess": 5}
    {"method": "eagle3", "model": "/path/to/head", "num_speculative_tokens": 3}

`ngram` drafts by prompt lookup: the tokens that followed the last earlier occurrence of the
sequence's final n tokens (n from prompt_lookup_max down to prompt_lookup_min). `layer_skip`
drafts with the target model's own first `num_layers` layers and its LM head (a self-draft:
no second model, and no cache of its own, since those layers' keys and values are the
target's). "model" names a separate draft model (method draft_model) that shares the
target's vocabulary: it runs on the same ranks with the same TP, in a paged cache of its own
indexed by the target's block tables. "deepseek_mtp" drafts with DeepSeek-V3's own
multi-token-prediction layer, read from the target's checkpoint (engine/spec/mtp.py), applied
recurrently for K > 1. "lookahead" (Fu et al. 2024) drafts `window` tokens a step from a
Jacobi window and a per-sequence pool of `ngram`-grams (at most `guess` kept per first token),
with no model (engine/spec/lookahead.py); its K is `window`. "eagle3" drafts with an EAGLE-3
head in the layout published for vLLM and SGLang (`model`: its directory; engine/spec/eagle3.py),
fed the target's hidden states at three layers from the same forward.

topk (SGLang's --speculative-eagle-topk), eagle3 and deepseek_mtp: above 1 the drafter proposes a
tree, `num_speculative_tokens` deep, keeping the `topk` likeliest nodes (by the draft's path
probability) at each depth: topk x num_speculative_tokens drafted nodes in all (SGLang's
--speculative-num-draft-tokens = that + 1), verified in one target forward with a tree attention
mask (engine/sample/tree.py); the longest accepted path is kept.

disable_by_batch_size (vLLM's spelling): a step drafts nothing when its lane runs at least
this many sequences, since at large batch the verify forward is no longer nearly free. min_acceptance_rate: a sequence
whose last `acceptance_window` verify steps accepted less than this share of their drafted
tokens drafts nothing for its next `pause_steps` decode steps, then tries again (None: never
pauses).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields

from atoll.errors import InputError

METHODS = ("ngram", "layer_skip", "draft_model", "deepseek_mtp", "lookahead", "eagle3")
LOOKAHEAD = ("window", "ngram", "guess")
NOT_BUILT = ("eagle", "medusa", "mlp_speculator")


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 3
    prompt_lookup_min: int = 1
    prompt_lookup_max: int = 4
    num_layers: int | None = None  # layer_skip: the target's first layers the draft runs (default: a quarter)
    disable_by_batch_size: int | None = None
    model: str | None = None  # draft_model: the draft checkpoint's directory
    draft_tensor_parallel_size: int | None = None  # draft_model: the target's tp (the only one run)
    window: int | None = None  # lookahead: drafted tokens a step, the Jacobi window (default 5)
    ngram: int | None = None  # lookahead: the pool's n-gram length, first token included (default 4)
    guess: int | None = None  # lookahead: n-grams kept per first token (default 5)
    min_acceptance_rate: float | None = None  # below it over acceptance_window verify steps: pause
    acceptance_window: int = 8
    pause_steps: int = 32
    topk: int = 1  # eagle3, deepseek_mtp: > 1 drafts a tree (SGLang's --speculative-eagle-topk)

    def __post_init__(self):
        if self.method not in METHODS:
            if self.method in NOT_BUILT:
                raise InputError(f"speculative method {self.method!r} is not built yet: use one of "
                                 f"{', '.join(METHODS)}")
            raise InputError(f"unknown speculative method {self.method!r}: use one of {', '.join(METHODS)}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max", "num_layers",
                     "disable_by_batch_size", "draft_tensor_parallel_size", "acceptance_window", "pause_steps",
                     "topk", *LOOKAHEAD):
            value = getattr(self, name)
            if value is None and name in ("num_layers", "disable_by_batch_size", "draft_tensor_parallel_size",
                                          *LOOKAHEAD):
                continue
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InputError(f"speculative {name}={value!r} must be a whole number of at least 1")
        rate = self.min_acceptance_rate
        if rate is not None and (isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate <= 1):
            raise InputError(f"speculative min_acceptance_rate={rate!r} must be a number in (0, 1]")
        self._check_lookahead()
        if self.topk > 1 and self.method not in ("eagle3", "deepseek_mtp"):
            raise InputError(f"speculative topk={self.topk} (tree drafts) goes with method eagle3 or deepseek_mtp, "
                             f"not {self.method}")
        if (self.method in ("draft_model", "eagle3")) != (self.model is not None):
            raise InputError(f"speculative \"model\" (a draft checkpoint or an EAGLE-3 head's directory) goes with "
                             f"method draft_model or eagle3, and is needed there (method {self.method})")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise InputError(f"speculative prompt_lookup_min={self.prompt_lookup_min} is above "
                             f"prompt_lookup_max={self.prompt_lookup_max}")

    def _check_lookahead(self) -> None:
        given = [name for name in LOOKAHEAD if getattr(self, name) is not None]
        if self.method != "lookahead":
            if given:
                raise InputError(f"speculative {given[0]!r} goes with method lookahead, and only there")
            return
        defaults = {"window": 5, "ngram": 4, "guess": 5}
        for name in LOOKAHEAD:
            if getattr(self, name) is None:
                object.__setattr__(self, name, defaults[name])
        if self.ngram < 2:
            raise InputError(f"speculative ngram={self.ngram} must be at least 2 (a first token and what follows it)")
        if self.window < self.ngram - 1:
            raise InputError(f"speculative window={self.window} is shorter than ngram - 1 = {self.ngram - 1}: "
                             "a pool candidate must fit in the draft")

    @property
    def k(self) -> int:
        """Drafted tokens a step at most: num_speculative_tokens, or lookahead's window."""
        return self.window if self.method == "lookahead" else self.num_speculative_tokens

    @classmethod
    def parse(cls, value) -> "SpeculativeConfig":
        """From a SpeculativeConfig, a dict, or its JSON text (the CLI's); one clear line on bad input."""
        if isinstance(value, cls):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise InputError(f"--speculative-config is not JSON: {e.msg} at character {e.pos}") from None
        if not isinstance(value, dict):
            raise InputError(f"speculative_config must be a JSON object, got {type(value).__name__}")
        value = dict(value)
        if "model" in value and "method" not in value:  # vLLM's spelling of a draft model
            value["method"] = "draft_model"
        if "method" not in value:
            raise InputError(f"speculative_config needs a \"method\": one of {', '.join(METHODS)}")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise InputError(f"speculative_config: unknown key {unknown[0]!r} (known: {', '.join(sorted(known))})")
        return cls(**value)
