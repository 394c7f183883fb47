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


class HeaderSource:
    """A checkpoint tensor known only by its safetensors header: indexing gives a meta tensor
    of the slice's shape, so a model built on `meta` can run every weight_loader (shapes
    checked, nothing read) before any rank starts."""

    def __init__(self, name: str, shape: tuple[int, ...]):
        self.name = name
        self._full = torch.empty(shape, device="meta")

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self._full.shape)

    def __getitem__(self, index):
        return self._full[index]


def slice_stops(index, ndim: int) -> list[int | None]:
    """How far `src[index]` reads each dimension: a slice's stop, None where the index does
    not bound it (`:`, a dimension left out, or an index too unusual to read)."""
    index = index if isinstance(index, tuple) else (index,)
    if len(index) > ndim or any(i is Ellipsis or i is None for i in index):
        return [None] * ndim
    stops = [None] * ndim
    for d, i in enumerate(index):
        if isinstance(i, slice) and i.stop is not None and i.stop >= 0 and (i.step or 1) > 0:
            stops[d] = i.stop
    return stops


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
    from atoll.models import build_model
    from atoll.models.checkpoint import load_weights
    from atoll.parallel.layout import Layout
    from atoll.parallel.mesh import ParallelContext

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
