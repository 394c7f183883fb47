"""Every checkpoint tensor's stored shape against the one the model config gives it, from the
safetensors headers, before any rank starts.

The whole model is built on one meta rank (tp = pp = ep = 1), so each weight_loader reads its
tensors whole. A ShapeProbe records how far each dimension is read and hands back a meta slice
of the shape asked for, even past the stored end, so every loader runs through; a tensor
stored shorter or longer than that is then named with both shapes. A dimension a loader reads
whole (`:`) is compared when the slice is copied into its parameter. Nothing is special-cased
by tensor name: the loaders say what they read.
"""

from __future__ import annotations

import torch

from atoll.errors import CheckpointError
from atoll.models import build_model
from atoll.models.checkpoint import Checkpoint, load_weights
from atoll.models.header_source import HeaderSource
from atoll.models.safetensors_header import slice_stops
from atoll.models.strict import check_all_read
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext


class ProbeSlice(torch.Tensor):
    """A meta slice a ShapeProbe hands out. Copied into a parameter slice of another shape it
    raises the ValueError of layers.linear.copy_into (which the loader then names), whether or
    not the loader checks shapes itself; on meta, copy_ would only broadcast or fail."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if func is torch.Tensor.copy_ and tuple(args[0].shape) != tuple(args[1].shape):
            raise ValueError(f"shape mismatch: parameter slice {tuple(args[0].shape)} vs checkpoint "
                             f"{tuple(args[1].shape)}")
        return super().__torch_function__(func, types, args, kwargs)


class ShapeProbe(HeaderSource):
    """A HeaderSource that records in `reach[name]` how far each dimension was read, and
    hands back a meta slice of the shape asked for even past the stored end, so a loader runs
    through and check_shapes names the tensor with both shapes."""

    def __init__(self, name: str, shape: tuple[int, ...], reach: dict):
        super().__init__(name, shape)
        self._reach = reach

    def __getitem__(self, index):
        stops = slice_stops(index, self._full.dim())
        reach = self._reach.setdefault(self.name, [None] * len(stops))
        for d, stop in enumerate(stops):
            if stop is not None:
                reach[d] = max(reach[d] or 0, stop)
        padded = [max(n, s or 0) for n, s in zip(self._full.shape, stops)]
        return torch.empty(padded, device="meta")[index].as_subclass(ProbeSlice)


def check_shapes(ckpt, config) -> None:
    """Every checkpoint tensor's stored shape is the one the model config gives it, with no
    rank started: the whole model's weight_loaders run over ShapeProbes on one meta rank. A
    dimension a loader reads to a bound must end there; one it reads whole (`:`) is compared
    when it is copied. Raises CheckpointError naming the first tensor that differs and its file."""
    model = build_model(config, ParallelContext.detached(Layout(), 0, device="meta"), dtype=torch.float32)
    reach: dict[str, list] = {}
    load_weights(model, ckpt, get=lambda name: ShapeProbe(name, ckpt.shape(name), reach))
    for name in ckpt.names():
        if name not in reach:
            continue  # not read whole-model (an fp8 weight's scales: checked with the weight)
        shape = ckpt.shape(name)
        need = tuple(shape[d] if r is None else r for d, r in enumerate(reach[name]))
        if need != shape:
            raise CheckpointError(f"tensor {name} does not fit the model config: {ckpt.path_of(name)} stores "
                                  f"it as {shape}, the config gives it {need}")


def check_layout_fits(model_dir, config, layout) -> None:
    """Every rank's weight slices checked against the checkpoint's headers, in this process:
    first each tensor whole against the config (check_shapes above: a wrong shape is named
    with its file and both shapes), then the first and last rank of each pipeline stage build
    their part on `meta` and run their weight_loaders over header-only sources (sharding is
    uniform, so the ends of each stage stand for the ranks between). Raises the CheckpointError
    the rank would have raised, and names a tensor that no stage has a parameter for (the ranks check expert ids too)."""
    ckpt = Checkpoint(model_dir)
    check_shapes(ckpt, config)  # every tensor whole, against the config, before any slicing
    stage = layout.stage_size
    ranks = sorted({r for p in range(layout.pp) for r in (p * stage, p * stage + stage - 1)})
    offered = set()
    for rank in ranks:
        ctx = ParallelContext.detached(layout, rank, device="meta")
        model = build_model(config, ctx, dtype=torch.float32)
        offered |= load_weights(model, ckpt, get=ckpt.header).offered
    check_all_read(ckpt, offered, config)
