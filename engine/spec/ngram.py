"""The n-gram drafter (prompt lookup): the sequence's last n tokens (n from prompt_lookup_max down
to prompt_lookup_min) are searched for earlier in its tokens, latest occurrence first; the
tokens that followed it are the draft. No model, no cache: every rank drafts the same tokens
from the same tokens."""

from __future__ import annotations

from atoll.engine.spec.drafter import Drafter


class NgramDrafter(Drafter):
    method = "ngram"

    @classmethod
    def check(cls, cfg, layout, config, model_dir) -> None:
        """No model and no cache: any layout."""

    def propose(self, wants):
        lo, hi = self.cfg.prompt_lookup_min, self.cfg.prompt_lookup_max
        return [ngram_lookup(seq.tokens, lo, hi, k) for seq, k in wants]


def ngram_lookup(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The k tokens that followed the latest earlier occurrence of the last n tokens, for the
    longest n in hi..lo that occurs; [] when none does."""
    size = len(tokens)
    for n in range(min(hi, size - 1), lo - 1, -1):
        pattern = tokens[size - n:]
        first = pattern[0]
        for i in range(size - n - 1, -1, -1):
            if tokens[i] == first and tokens[i:i + n] == pattern:
                return tokens[i + n:i + n + k]
    return []
