"""Which ep rank holds which experts: plain arithmetic, no torch (the planner counts with it too)."""

from __future__ import annotations


def expert_split(num_experts: int, ep: int) -> list[int]:
    """Experts per ep rank. Ranks hold contiguous blocks of expert ids and the first
    num_experts % ep ranks hold one more: 10 experts over 4 ranks -> [3, 3, 2, 2], so rank 1
    holds experts 3, 4, 5. With fewer experts than ranks the last ranks hold none."""
    base, extra = divmod(num_experts, ep)
    return [base + (r < extra) for r in range(ep)]


def expert_starts(split: list[int]) -> list[int]:
    starts, at = [], 0
    for n in split:
        starts.append(at)
        at += n
    return starts
