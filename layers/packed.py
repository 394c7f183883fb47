"""Packed copies of linear weights for CPU products, held by the layer that owns the weight.

On CPU, float32 `F.linear` repacks the weight into MKL's GEMM layout on every call; for the
few rows of a decode step that repacking costs as much as the product itself. `Packer` keeps
one packed copy of every linear weight for the batch size decode runs at (MKL's packed
product is used only for exactly that many rows; it matches F.linear to float32 rounding),
and repacks when decode has run at another size for a few steps in a row. The price is one
more copy of the weights in memory: the runner packs only when that copy fits in a quarter
of the free memory its machine's ranks share. Off by default (not bit for bit F.linear on every
CPU, and not faster on every one); the config's mkl_pack (--mkl-pack, env ATOLL_MKL_PACK=1)
turns it on.

Every layer whose weight goes through `linear` (layers/linear.py, the LM head) holds a `Packs`,
empty until Packer, pack_onednn or tune_onednn fill it, and hands it to `linear` with its
weight: the copies live and die with the layer. The packers take the layers (anything with a
`weight` and its `packs`), so nothing is attached to the weight tensors themselves.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atoll.kernels.fp8 import fp8_linear
from atoll.layers.quant_linear import int8_linear

try:  # torch's opaque objects: how a custom op takes a Python object through a compiled graph
    from torch._library.opaque_object import get_opaque_type_name, register_opaque_type
    from torch._opaque_base import OpaqueBase
except ImportError:  # an older torch: the compiled step multiplies by F.linear (pack_onednn packs nothing)
    OpaqueBase, register_opaque_type = object, None


class OnednnWeight(OpaqueBase):
    """A weight's oneDNN-packed copy (an opaque mkldnn tensor) and the shape it was packed from.

    Dynamo cannot take an mkldnn tensor as a graph input, nor can inductor's cache store one as a
    constant; wrapped in this object, registered as an opaque reference type, it is an input of
    the compiled graph like the weight itself, so the graph's call of atoll::onednn_linear is
    handed the copy of the layer running it and one graph serves every layer. Registered with
    hoist=True, which is what lets inductor's FX graph cache key the graph by the type's name
    instead of pickling the object (a packed tensor does not pickle)."""

    def __init__(self, tensor: torch.Tensor, shape: torch.Size):
        self.tensor = tensor
        self.shape = shape


COMPILED_ONEDNN = False  # whether atoll::onednn_linear exists (this torch has opaque objects)
if register_opaque_type is not None:
    try:
        register_opaque_type(OnednnWeight, typ="reference", hoist=True)
        COMPILED_ONEDNN = True
    except TypeError:  # a torch whose opaque objects cannot be hoisted: the graph would not be cached
        pass


@dataclass(eq=False)
class Packs:
    """One layer's packed copies of its weight, read by `linear`; None until packed.
    mkl: (rows, MKL-packed copy), used for products of exactly that many rows (Packer);
    onednn_copy: the oneDNN-packed copy, any row count (pack_onednn for the compiled step,
    tune_onednn for the eager one); in_eager: eager products of at most EAGER_MAX_ROWS rows take
    it too (tune_onednn measured it faster for this weight's shape)."""

    mkl: tuple[int, torch.Tensor] | None = None
    onednn_copy: OnednnWeight | None = None
    in_eager: bool = False


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
           scale: torch.Tensor | None = None, input_scale: torch.Tensor | None = None, *,
           packs: Packs | None = None) -> torch.Tensor:
    """F.linear, through the weight's packed copy in `packs` (the layer's) when it has one for
    x's row count; an int8 weight with its per-row `scale` through layers.quant_linear, an fp8
    one with its per-row-and-128-column scales (and a checkpoint's static input_scale) through
    kernels.fp8."""
    if scale is not None:
        if weight.dtype == torch.int8:
            return int8_linear(x, weight, scale, bias)
        return fp8_linear(x, weight, scale, bias=bias, input_scale=input_scale)
    if x.dim() == 2 and x.device.type == "cpu" and torch.compiler.is_compiling():
        if x.shape[0] == 1:
            return row_product(x, weight, bias)
        if packs is not None and packs.onednn_copy is not None:
            return torch.ops.atoll.onednn_linear(x, weight, bias, packs.onednn_copy)
    if packs is None or x.dim() != 2:
        return F.linear(x, weight, bias)
    if packs.in_eager and x.shape[0] <= EAGER_MAX_ROWS:
        return _onednn_product(x, weight, bias, packs.onednn_copy)
    if packs.mkl is not None and x.shape[0] == packs.mkl[0]:
        return torch.ops.mkl._mkl_linear(x, packs.mkl[1], weight, bias, packs.mkl[0])
    return F.linear(x, weight, bias)


def row_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x: [1, in] @ weight.T as one reduction over each weight row: inductor makes it one
    vectorised pass over the weight, which streams it faster than oneDNN's or MKL's GEMM does
    at one row (see engine/step/compiled.py: the one-sequence graph)."""
    out = (weight * x).sum(-1).unsqueeze(0)
    return out if bias is None else out + bias


def mkl_can_pack() -> bool:
    return torch.backends.mkl.is_available() and hasattr(torch.ops.mkl, "_mkl_reorder_linear_weight")


def _packable(weight: torch.Tensor, dtypes: tuple) -> bool:
    return weight.dim() == 2 and weight.device.type == "cpu" and weight.dtype in dtypes


class Packer:
    """Packs the weights of `layers` (each with a `weight` read by `linear` and its `packs`;
    2-D float32 CPU weights only) for the decode batch size."""

    def __init__(self, layers: list, patience: int = 3):
        self.layers = [m for m in layers if _packable(m.weight, (torch.float32,))]
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
        for m in self.layers:
            m.packs.mkl = None  # free the old copy first: one extra copy at most
            m.packs.mkl = (rows, torch.ops.mkl._mkl_reorder_linear_weight(m.weight.data, rows))
        self.rows = rows


# --- oneDNN-packed weights: for the compiled CPU decode step (engine.step.compiled), and for
# the eager one where they measure faster (tune_onednn) ---
ONEDNN_DTYPES = (torch.float32, torch.bfloat16)


def onednn_can_pack() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def _pack_layers(layers: list, rows: int) -> int:
    """Gives each of `layers` whose weight oneDNN packs (2-D CPU float32 / bfloat16) a packed
    copy in its packs, packed for about `rows` rows (any row count runs) unless it has one;
    returns the layers that have one."""
    done = 0
    for m in layers:
        w = m.weight
        if not _packable(w, ONEDNN_DTYPES):
            continue
        if m.packs.onednn_copy is None:
            m.packs.onednn_copy = OnednnWeight(torch.ops.mkldnn._reorder_linear_weight(w.detach(), rows), w.shape)
        done += 1
    return done


def pack_onednn(layers: list, rows: int = 16) -> int:
    """For the compiled step: packs each layer's 2-D CPU weight once for oneDNN, which `linear`
    inside a compiled graph then multiplies by. Returns the layers packed (none where this
    torch cannot pass the copy through a graph: COMPILED_ONEDNN)."""
    if not onednn_can_pack() or not COMPILED_ONEDNN:
        return 0
    return _pack_layers(layers, rows)


# Products of at most this many rows (decode steps, short prefills) go through a weight's
# packed copy once tune_onednn has chosen it; longer ones stay with F.linear.
EAGER_MAX_ROWS = 64
TUNE_REPEATS = 5  # timed products a side and shape, after two untimed ones
TUNE_MARGIN = 0.9  # a shape's packed product is taken when it takes at most this share of F.linear's
# the tuning runs ~14 products of each shape: a job of fewer decode steps than this could not
# repay it even where the packed product is twice as fast, so it is not tuned
TUNE_MIN_STEPS = 32


def tune_onednn(layers: list, rows: int) -> dict:
    """For eager decode: times, for each distinct weight shape of `layers` (each with a `weight`
    and its `packs`), F.linear against its oneDNN-packed product at `rows` rows on this machine,
    and packs the weight of every layer of the shapes where the packed one wins (by
    TUNE_MARGIN), for `linear` to take in eager products. Whichever wins depends on the CPU and
    its BLAS (oneDNN streamed SmolLM2's weights up to 2x faster at 1-16 rows on a 2-core AMD
    EPYC, but not its small k/v projections), hence a measurement, not a rule. Returns
    {"packed": layers packed, "weights": weights seen, "plain_s", "packed_s": seconds a step of
    these products takes each way, as measured}."""
    out = {"packed": 0, "weights": 0, "plain_s": 0.0, "packed_s": 0.0}
    if not onednn_can_pack():
        return out
    shapes: dict[tuple, list] = {}
    for m in layers:
        if _packable(m.weight, ONEDNN_DTYPES):
            shapes.setdefault((tuple(m.weight.shape), m.weight.dtype), []).append(m)
    rows = max(1, min(rows, EAGER_MAX_ROWS))
    for (shape, dtype), group in shapes.items():
        w = group[0].weight.detach()
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
        _pack_layers(group, rows)
        for m in group:
            m.packs.in_eager = True
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


def _onednn_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                    packed: OnednnWeight) -> torch.Tensor:
    """The product through `packed`, weight's packed copy, or F.linear where the layer's weight
    was since replaced by one of another shape."""
    if packed.shape != weight.shape:
        return F.linear(x, weight, bias)
    return torch.ops.mkldnn._linear_pointwise(x, packed.tensor, bias, "none", [], "")


def _onednn_fake(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, packed) -> torch.Tensor:
    return x.new_empty(x.shape[0], weight.shape[0])


# atoll::onednn_linear(x, weight, bias, packed): x @ weight.T (+ bias) through `packed`, weight's
# oneDNN-packed copy (pack_onednn), for the compiled graph. Defined through torch.library.Library
# with a CPU kernel rather than torch.library.custom_op, whose Python wrapping of each call cost
# ~25 us more a product (47 against 20 us for a 16 x 16 product, 121 products a SmolLM2 step).
_LIBRARY = None  # the operator's registrations last as long as this object
if COMPILED_ONEDNN:
    _LIBRARY = torch.library.Library("atoll", "FRAGMENT")
    _LIBRARY.define("onednn_linear(Tensor x, Tensor weight, Tensor? bias, "
                    f"{get_opaque_type_name(OnednnWeight)} packed) -> Tensor")
    _LIBRARY.impl("onednn_linear", lambda x, weight, bias, packed: _onednn_product(x, weight, bias, packed), "CPU")
    torch.library.register_fake("atoll::onednn_linear", _onednn_fake, lib=_LIBRARY)
