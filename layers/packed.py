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

import time
import weakref

import torch
import torch.nn.functional as F

from atoll.kernels.fp8 import fp8_linear
from atoll.layers.quant_linear import int8_linear


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the weight's packed copy when it was packed for x's row count; an
    int8 weight with its per-row `scale` through layers.quant_linear, an fp8 one with its
    per-row-and-128-column scales (and a checkpoint's static input_scale) through kernels.fp8."""
    if scale is not None:
        if weight.dtype == torch.int8:
            return int8_linear(x, weight, scale, bias)
        return fp8_linear(x, weight, scale, bias=bias, input_scale=input_scale)
    if x.dim() == 2 and x.device.type == "cpu" and torch.compiler.is_compiling():
        if x.shape[0] == 1:
            return row_product(x, weight, bias)
        if getattr(weight, "onednn", False):
            return torch.ops.atoll.onednn_linear(x, weight, bias)
    if getattr(weight, "onednn_eager", False) and x.dim() == 2 and x.shape[0] <= EAGER_MAX_ROWS:
        return _onednn_product(x, weight, bias)
    packed = getattr(weight, "packed", None)
    if packed is not None and x.dim() == 2 and x.shape[0] == packed[0]:
        return torch.ops.mkl._mkl_linear(x, packed[1], weight, bias, packed[0])
    return F.linear(x, weight, bias)


def row_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [1, in] @ weight.T as one reduction over each weight row: inductor makes it one
    vectorised pass over the weight, which streams it faster than oneDNN's or MKL's GEMM does
    at one row (see engine/step/compiled.py: the one-sequence graph)."""
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


# --- oneDNN-packed weights for the compiled CPU decode step (engine.step.compiled) ---
# The packed copy is an opaque oneDNN tensor, which dynamo cannot take as an input and
# inductor's cache cannot store as a constant: the graph calls atoll::onednn_linear with the
# plain weight as its input, and the operator finds the packed copy by the weight's address.
_ONEDNN: dict[int, tuple[torch.Size, torch.Tensor]] = {}


def onednn_can_pack() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def pack_onednn(weights: list[torch.Tensor], rows: int = 16) -> int:
    """Packs each 2-D CPU weight once for oneDNN (for about `rows` rows; any row count runs)
    and marks it for `linear` inside a compiled graph; the copy is dropped with the weight.
    Returns the weights packed."""
    if not onednn_can_pack():
        return 0
    done = 0
    for w in weights:
        if w.dim() != 2 or w.device.type != "cpu" or w.dtype not in (torch.float32, torch.bfloat16):
            continue
        key = w.data_ptr()
        if key not in _ONEDNN:
            _ONEDNN[key] = (w.shape, torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows))
            weakref.finalize(w, _ONEDNN.pop, key, None)
        w.onednn = True
        done += 1
    return done


# --- oneDNN-packed weights for the eager decode step, where they measure faster ---
# Products of at most this many rows (decode steps, short prefills) go through a weight's
# packed copy once tune_onednn has chosen it; longer ones stay with F.linear.
EAGER_MAX_ROWS = 64
TUNE_REPEATS = 5  # timed products a side and shape, after two untimed ones
TUNE_MARGIN = 0.9  # a shape's packed product is taken when it takes at most this share of F.linear's
# the tuning runs ~14 products of each shape: a job of fewer decode steps than this could not
# repay it even where the packed product is twice as fast, so it is not tuned
TUNE_MIN_STEPS = 32


def tune_onednn(weights: list[torch.Tensor], rows: int) -> dict:
    """For eager decode: times, for each distinct weight shape, F.linear against its
    oneDNN-packed product at `rows` rows on this machine, and packs every weight of the shapes
    where the packed one wins (by TUNE_MARGIN), marking them for `linear`. Whichever wins
    depends on the CPU and its BLAS (oneDNN streamed SmolLM2's weights up to 2x faster at 1-16
    rows on a 2-core AMD EPYC, but not its small k/v projections), hence a measurement, not a
    rule. Returns {"packed": weights packed, "weights": weights seen, "plain_s", "packed_s":
    seconds a step of these products takes each way, as measured}."""
    out = {"packed": 0, "weights": 0, "plain_s": 0.0, "packed_s": 0.0}
    if not onednn_can_pack():
        return out
    shapes: dict[tuple, list[torch.Tensor]] = {}
    for w in weights:
        if w.dim() == 2 and w.device.type == "cpu" and w.dtype in (torch.float32, torch.bfloat16):
            shapes.setdefault((tuple(w.shape), w.dtype), []).append(w)
    rows = max(1, min(rows, EAGER_MAX_ROWS))
    for (shape, dtype), group in shapes.items():
        w = group[0].detach()
        x = torch.randn(rows, shape[1], dtype=dtype)
        plain_s = _best_of(lambda: F.linear(x, w))
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, rows)
            packed_s = _best_of(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))
        except RuntimeError:  # this oneDNN build does not pack this dtype here
            packed_s = float("inf")
        out["weights"] += len(group)
        out["plain_s"] += plain_s * len(group)
        if packed_s > TUNE_MARGIN * plain_s:
            out["packed_s"] += plain_s * len(group)
            continue
        out["packed_s"] += packed_s * len(group)
        pack_onednn(group, rows)
        for g in group:
            g.onednn_eager = True
        out["packed"] += len(group)
    return out


def _best_of(fn) -> float:
    fn(), fn()
    best = float("inf")
    for _ in range(TUNE_REPEATS):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


@torch.library.custom_op("atoll::onednn_linear", mutates_args=())
def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x @ weight.T (+ bias) through weight's oneDNN-packed copy (pack_onednn)."""
    return _onednn_product(x, weight, bias)


def _onednn_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """The packed product where weight has a packed copy, else F.linear (not packed, or its
    address reused by another tensor)."""
    shape, packed = _ONEDNN.get(weight.data_ptr(), (None, None))
    if shape != weight.shape:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


@onednn_linear.register_fake
def _(x, weight, bias):
    return x.new_empty(x.shape[0], weight.shape[0])
