"""A MoE layer's expert load counter and, with redundant experts (EPLB), its map from the
router's logical experts to physical slots (comm/eplb.py places them).

Counting. `ExpertLoad.count(ids, keep)` adds each kept (token, expert) pair into a counter of
tokens per physical slot, in place: one index_add_ of fixed shape, no host read, so it runs
inside a CUDA graph and a fullgraph torch.compile, where the counter is a buffer the graph
writes (no recompile per layer or per step: every layer's counter is an input of the same
graph). Physical, not logical: a rank's load is what its own slots took, and the logical
load is the sum over an expert's copies (Placement.logical_loads). Which rows count is the
layer's business (layers/moe.py: padding rows and rows another ep rank counts are not kept).

Routing. `ExpertMap.route(ids, first)` sends the pair of row i, slot j (ids [n, k]) to copy
(pair position) mod copies of its expert, pair position = (first + i) * k + j: first is
the row's place among the rows the ep group routes together, so ranks that route the same
rows pick the same copy, and consecutive pairs of one expert take its copies in turn (each
copy about load / copies, which the placement balances). The tables are device tensors of
fixed shape [E, R + 1], rewritten in place by `set` when a rebalance switches (a captured
graph keeps reading them).
"""

from __future__ import annotations

import torch
from torch import nn

from atoll.comm.eplb import Placement


class ExpertLoad(nn.Module):
    """Tokens routed to each physical slot since the window last took them: `counts` [P]
    int64, which the model may point at a row of one stage-wide tensor (models/moe.py)."""

    def __init__(self, slots: int):
        super().__init__()
        self.register_buffer("counts", torch.zeros(slots, dtype=torch.long), persistent=False)

    def count(self, ids: torch.Tensor, keep: torch.Tensor | None = None) -> None:
        """ids: [n, k] physical slots (-1: none); keep: [n] bool, the rows to count (None: all)."""
        valid = ids >= 0
        if keep is not None:
            valid = valid & keep[:, None]
        self.counts.index_add_(0, ids.clamp(min=0).reshape(-1), valid.reshape(-1).to(self.counts.dtype))


class ExpertMap(nn.Module):
    """Logical -> physical routing over a Placement's copies."""

    def __init__(self, placement: Placement):
        super().__init__()
        width = placement.num_slots - placement.num_logical + 1  # the most copies one expert can have
        E = placement.num_logical
        self.register_buffer("table", torch.zeros(E, width, dtype=torch.long), persistent=False)
        self.register_buffer("copies", torch.ones(E, dtype=torch.long), persistent=False)
        self.set(placement)

    @torch.no_grad()
    def set(self, placement: Placement) -> None:
        """Take `placement`'s copies, in place (the tensors keep their storage)."""
        table = torch.zeros_like(self.table, device="cpu")
        copies = torch.zeros_like(self.copies, device="cpu")
        for e, slots in enumerate(placement.copies()):
            table[e, :len(slots)] = torch.tensor(slots)
            copies[e] = len(slots)
        self.table.copy_(table)
        self.copies.copy_(copies)

    def route(self, ids: torch.Tensor, first=0) -> torch.Tensor:
        """ids: [n, k] logical experts (the router's, all valid) -> [n, k] physical slots."""
        n, k = ids.shape
        pairs = (torch.arange(n, device=ids.device)[:, None] + first) * k + torch.arange(k, device=ids.device)
        which = torch.remainder(pairs, self.copies[ids])
        return self.table[ids, which]
