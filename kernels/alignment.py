"""The aligned (expert-sorted, block-padded) layout that moe_align makes and the grouped GEMM
and unpermute_reduce read.

A (token, slot) pair is named by its flat index i = token * top_k + slot into topk_ids. The
pairs routed to local expert e are listed contiguously, in increasing i, and each expert's
run is padded with the sentinel i = pairs (tokens * top_k) up to a multiple of block_m, so
every block of block_m rows belongs to exactly one expert. Pairs whose expert is not local
(id - expert_offset outside [0, experts)) are left out and contribute nothing.

Buffers are sized by the bound `max_rows` so nothing needs a device-to-host sync; the rows
actually used are the first `rows[0]` (a device scalar), and blocks past it are skipped.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def max_rows(pairs: int, experts: int, block_m: int) -> int:
    """Rows the aligned layout can need: every non-empty expert pads at most block_m - 1, and
    at most min(experts, pairs) experts are non-empty. Rounded up to whole blocks."""
    bound = pairs + min(experts, pairs) * (block_m - 1)
    return max(block_m, -(-bound // block_m) * block_m)


@dataclass
class MoeAlignment:
    sorted_ids: torch.Tensor    # [max_rows] int32: flat pair index per row, `pairs` for padding
    block_expert: torch.Tensor  # [max_rows / block_m] int32: local expert of each block, -1 unused
    rows: torch.Tensor          # [1] int32: rows in use (a multiple of block_m)
    position: torch.Tensor      # [pairs] int32: row of each pair in the layout, -1 if not local
    block_m: int
    top_k: int
    experts: int                # local experts

    @property
    def pairs(self) -> int:
        return self.position.numel()

    @property
    def tokens(self) -> int:
        return self.pairs // self.top_k

    @property
    def max_rows(self) -> int:
        return self.sorted_ids.numel()

    def valid_rows(self) -> torch.Tensor:
        """[max_rows] bool: rows holding a real pair (not padding, not past `rows`)."""
        return self.sorted_ids < self.pairs
