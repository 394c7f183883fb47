"""How a decode step's rows are grouped by context (attention's Metadata.decode_groups), in
plain Python: the planner's simulator asks it too, to tell as the engine does which decode
ticks the compiled CPU step leaves to the eager step (a tick whose rows split into groups).

One group reading every row's keys up to the longest context pays the longest row's gather and
attention on every row (a 1,024-token sequence beside fifteen of 100 made a step 10x slower on a
CPU), so rows are grouped by their context's power-of-two block count (contexts up to
GROUP_MIN_KEYS together) when that reads at most GROUP_SHARE of the keys one group would.
"""

from __future__ import annotations

GROUP_SHARE = 0.6  # a step is split when its groups read at most this share of the keys
GROUP_MIN_KEYS = 256  # ... and rows of contexts up to this many keys stay in one group


def context_groups(starts: list[int], block_size: int) -> list[list[int]] | None:
    """The rows (indices into starts, each row's first new position) of each group, or None
    when the step runs as one group."""
    widths = [-(-(start + 1) // block_size) for start in starts]
    least = -(-GROUP_MIN_KEYS // block_size)
    buckets: dict[int, list[int]] = {}
    for i, w in enumerate(widths):
        buckets.setdefault(max(1 << (w - 1).bit_length(), least), []).append(i)
    if len(buckets) == 1:
        return None
    cut = sum(len(rows) * max(widths[i] for i in rows) for rows in buckets.values())
    return None if cut > GROUP_SHARE * len(widths) * max(widths) else list(buckets.values())
