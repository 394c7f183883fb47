"""Gathering rows whose count differs per rank (DP ranks serve different batches)."""

from __future__ import annotations

import torch

from atoll.comm.group import Group


def row_counts(group: Group, n: int) -> list[int]:
    """Every rank's row count, in group order."""
    if group.size == 1:
        return [n]
    return group.all_gather(torch.tensor([n], dtype=torch.long, device=group.device), dim=0).tolist()


def all_gather_rows(group: Group, x: torch.Tensor, counts: list[int] | None = None) -> torch.Tensor:
    """x: [n_rank, ...] -> [sum of n over ranks, ...] in group order; ranks may hold 0 rows."""
    if group.size == 1:
        return x
    counts = counts or row_counts(group, x.shape[0])
    most = max(counts)
    if most == 0:  # every rank agrees from the counts, so all skip the gather together
        return x
    padded = x.new_zeros((most, *x.shape[1:]))
    padded[: x.shape[0]] = x
    parts = group.all_gather(padded, dim=0).split(most)
    return torch.cat([p[:n] for p, n in zip(parts, counts)])
