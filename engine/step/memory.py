"""Whether a second copy of weights fits this machine: the rule for the compiled step's frozen
weights and the eager step's packed ones."""

from __future__ import annotations

from atoll.engine.kv.sizing import available_memory


def copy_fits(nbytes: int, ranks_here: int) -> bool:
    """Whether one more copy of nbytes on each of this machine's ranks fits in a quarter of its
    available memory (the rule for prepacked weight copies)."""
    return nbytes * ranks_here <= available_memory() // 4
