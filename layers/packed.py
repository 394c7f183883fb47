"""MKL-packed weights for CPU decode.

On CPU, float32 `F.linear` repacks the weight into MKL's GEMM layout on every call; for the
few rows of a decode step that repacking costs as much as the product itself. `Packer` keeps
one packed copy of every linear weight for the batch size decode runs at (MKL's packed
product is used only for exactly that many rows; it matches F.linear to float32 rounding),
and repacks when decode has run at another size for a few steps in a row. The price is one
more copy of the weights in memory: the runner packs only when that copy fits in a quarter
of the free memory its machine's ranks share. Off by default (not bit for bit F.linear on every
CPU, and not faster on every one); the config's mkl_pack (--mkl-pack, env ATOLL_MKL_PACK=1)
turns it on.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the weight's packed copy when it was packed for x's row count."""
    if x.dim() == 2 and x.shape[0] == 1 and x.device.type == "cpu" and torch.compiler.is_compiling():
        return row_product(x, weight, bias)
    packed = getattr(weight, "packed", None)
    if packed is not None and x.dim() == 2 and x.shape[0] == packed[0]:
        return torch.ops.mkl._mkl_linear(x, packed[1], weight, bias, packed[0])
    return F.linear(x, weight, bias)


def row_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [1, in] @ weight.T as one reduction over each weight row: inductor makes it one
    vectorised pass over the weight, which streams it faster than oneDNN's or MKL's GEMM does
    at one row (see engine/compiled.py: the one-sequence graph)."""
    out = (weight * x).sum(-1).unsqueeze(0)
    return out if bias is None else out + bias


def mkl_can_pack() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


class Packer:
    """Packs `weights` (2-D float32 CPU tensors read by `linear`) for the decode batch size."""

    def __init__(self, weights: list[torch.Tensor], patience: int = 3):
        self.weights = [w for w in weights if w.dim() == 2 and w.dtype == torch.float32 and w.device.type == "cpu"]
        self.patience = patience
        self.rows: int | None = None  # the size packed for
        self._seen, self._streak = None, 0

    def observe(self, rows: int) -> None:
        """A decode step of `rows` rows is about to run; pack for it once it persists."""
        if rows == self.rows or rows < 1:
            return
        self._streak = self._streak + 1 if rows == self._seen else 1
        self._seen = rows
        if self._streak >= self.patience:
            self.pack(rows)

    def pack(self, rows: int) -> None:
        for w in self.weights:
            w.packed = None  # free the old copy first: one extra copy at most
            w.packed = (rows, torch.ops.mkl._mkl_reorder_linear_weight(w.data, rows))
        self.rows = rows
