"""A checkpoint tensor known only by its safetensors header, as a meta tensor."""

from __future__ import annotations

import torch


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
