"""fp8 block-quantized checkpoints, laid out as DeepSeek-V3's: config.json's
quantization_config says quant_method "fp8" and weight_block_size [128, 128]; each quantized
2-D weight is stored in float8 (e4m3) beside `<name>_scale_inv`, one fp32 scale per block of
128 x 128 elements (shape [ceil(rows/128), ceil(cols/128)]); the weight is fp8.float() times
its block's scale.

Fp8Source stands in for such a weight's checkpoint source, so the weight_loaders need no
change: indexing it reads only that slice of the fp8 weight and the scales of the blocks the
slice touches (a TP shard or an expert's moe_tp rows may start inside a block), and returns
the slice dequantized in float32; the loader casts it to the compute dtype as it copies.

ChannelFp8Source does the same for vLLM's per-tensor and per-channel layout
(models/fp8_scheme.py): `<m>.weight` in fp8 beside `<m>.weight_scale`, a scalar or one scale
per output row, and with static activations `<m>.input_scale`. A slice of rows reads those
rows' scales (a column-parallel shard splits them with its rows); a slice of columns reads
every row's (a row-parallel shard keeps them whole).
"""

from __future__ import annotations

import torch

from atoll.errors import CheckpointError
from atoll.kernels.fp8 import groups

FP8_DTYPES = ("F8_E4M3", "F8_E5M2")  # safetensors' names


class Fp8Source:
    """An fp8 weight and its block scales, indexed by row and column slices like the weight;
    weight and scale are lazy checkpoint sources (models.checkpoint.Source or HeaderSource)."""

    def __init__(self, name: str, weight, scale, block: tuple[int, int], device="cpu"):
        if len(weight.shape) != 2:
            raise CheckpointError(f"tensor {name} is fp8 with shape {tuple(weight.shape)}; atoll reads "
                                  "block-quantized 2-D weights only")
        rows, cols = weight.shape
        need = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(scale.shape) != need:
            raise CheckpointError(f"tensor {name}_scale_inv has shape {tuple(scale.shape)}; {name} of shape "
                                  f"{(rows, cols)} in blocks of {list(block)} needs {need}")
        self.name, self.weight, self.scale, self.block = name, weight, scale, block
        self.device = torch.device(device)
        self.parts = {name, name + "_scale_inv"}  # the checkpoint tensors this source reads

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.weight.shape)

    def raw(self) -> "RawFp8Source":
        """The same weight read as stored: for a destination kept in fp8 (layers.fp8_linear)."""
        return RawFp8Source(self.name, self.weight, self.scale, self.block, self.device)

    def __getitem__(self, index) -> torch.Tensor:
        (r0, r1), (c0, c1) = _bounds(index, self.shape)
        w = self.weight[r0:r1, c0:c1]
        if w.is_meta or w.numel() == 0:  # a header check: shapes only
            return w.to(torch.float32)
        out = w.to(self.device).to(torch.float32)  # [r1 - r0, c1 - c0]
        br, bc = self.block
        first_row, first_col = r0 // br, c0 // bc
        scale = self.scale[first_row:(r1 - 1) // br + 1, first_col:(c1 - 1) // bc + 1].to(self.device, torch.float32)
        # each column's scale in each row block: [row blocks, c1 - c0]
        per_col = scale.repeat_interleave(bc, dim=1)[:, c0 - first_col * bc:c1 - first_col * bc]
        for b in range(first_row, (r1 - 1) // br + 1):  # the slice's rows, block by block, in place
            a, z = max(r0, b * br), min(r1, (b + 1) * br)
            out[a - r0:z - r0] *= per_col[b - first_row]
        return out


class RawFp8Source(Fp8Source):
    """Slices of an fp8 weight as stored, each carrying `fp8_scale`: its block scales
    repeated per row, [rows, column blocks] (layers.fp8_linear's layout). The slice's columns
    must start on a block boundary."""

    def __getitem__(self, index) -> torch.Tensor:
        (r0, r1), (c0, c1) = _bounds(index, self.shape)
        br, bc = self.block
        if c0 % bc:
            raise ValueError(f"{self.name}: columns {c0}:{c1} start inside a {bc}-column scale block")
        q = self.weight[r0:r1, c0:c1]
        if q.is_meta or q.numel() == 0:
            return q
        if q.dtype != torch.float8_e4m3fn:  # e5m2: its range is not e4m3's; the destination requantizes
            return super().__getitem__(index)
        q = q.to(self.device)
        blocks = torch.arange(r0, r1) // br - r0 // br  # each row's block among those read
        scale = self.scale[r0 // br:(r1 - 1) // br + 1, c0 // bc:(c1 - 1) // bc + 1].to(self.device, torch.float32)
        q.fp8_scale = scale[blocks.to(self.device)]  # [rows, column blocks]
        return q


class ChannelFp8Source(Fp8Source):
    """An fp8 weight [rows, cols] with one scale per tensor or per output row, and an
    optional static input scale; indexed like the weight, dequantized in float32."""

    def __init__(self, name: str, weight, scale, input_scale=None, device="cpu", *, scale_name: str,
                 input_name: str | None = None):
        if len(weight.shape) != 2:
            raise CheckpointError(f"tensor {name} is fp8 with shape {tuple(weight.shape)}; atoll reads "
                                  "2-D fp8 weights only")
        rows, cols = weight.shape
        if tuple(scale.shape) not in ((), (1,), (1, 1), (rows,), (rows, 1)):
            raise CheckpointError(f"tensor {scale_name} has shape {tuple(scale.shape)}; {name} of shape "
                                  f"{(rows, cols)} needs one scale ([] or [1]) or one per output row "
                                  f"([{rows}] or [{rows}, 1])")
        if input_scale is not None and tuple(input_scale.shape) not in ((), (1,)):
            raise CheckpointError(f"tensor {input_name} has shape {tuple(input_scale.shape)}; a static input "
                                  "scale is one number (shape [] or [1])")
        self.name, self.weight, self.scale, self.input_scale = name, weight, scale, input_scale
        self.scale_name, self.input_name = scale_name, input_name
        self.per_tensor = tuple(scale.shape) in ((), (1,), (1, 1))
        self.device = torch.device(device)
        self.parts = {name, scale_name} | ({input_name} if input_scale is not None else set())

    def raw(self) -> "RawChannelFp8Source":
        return RawChannelFp8Source(self.name, self.weight, self.scale, self.input_scale, self.device,
                                   scale_name=self.scale_name, input_name=self.input_name)

    def row_scales(self, r0: int, r1: int) -> torch.Tensor:
        """float32 [r1 - r0]: each row's scale."""
        s = (self.scale[()] if self.per_tensor else self.scale[r0:r1]).to(self.device, torch.float32)
        return s.reshape(-1).expand(r1 - r0)

    def __getitem__(self, index) -> torch.Tensor:
        (r0, r1), (c0, c1) = _bounds(index, self.shape)
        w = self.weight[r0:r1, c0:c1]
        if w.is_meta or w.numel() == 0:
            return w.to(torch.float32)
        return w.to(self.device).to(torch.float32) * self.row_scales(r0, r1)[:, None]


class RawChannelFp8Source(ChannelFp8Source):
    """Slices of the fp8 weight as stored, each carrying `fp8_scale` (its rows' scales repeated
    over its 128-column groups: [rows, groups], layers.fp8_linear's layout, for any first
    column) and, with a static input scale, `fp8_input_scale` (a float32 scalar)."""

    def __getitem__(self, index) -> torch.Tensor:
        (r0, r1), (c0, c1) = _bounds(index, self.shape)
        q = self.weight[r0:r1, c0:c1]
        if q.is_meta or q.numel() == 0:
            return q
        if q.dtype != torch.float8_e4m3fn:  # e5m2: the destination requantizes
            return super().__getitem__(index)
        q = q.to(self.device)
        q.fp8_scale = self.row_scales(r0, r1)[:, None].expand(r1 - r0, groups(c1 - c0)).contiguous()
        if self.input_scale is not None:
            q.fp8_input_scale = self.input_scale[()].to(self.device, torch.float32).reshape(())
        return q


def _bounds(index, shape) -> list[tuple[int, int]]:
    """(start, stop) per dim of `src[a:b]`, `src[:, a:b]`, `src[:]` on a 2-D weight."""
    index = index if isinstance(index, tuple) else (index,)
    if len(index) > 2 or not all(isinstance(i, slice) for i in index):
        raise TypeError(f"an fp8 weight is read by row and column slices, not {index!r}")
    bounds = []
    for s, n in zip(index + (slice(None),) * (2 - len(index)), shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise TypeError(f"an fp8 weight is read by contiguous slices, not step {step}")
        bounds.append((start, max(start, stop)))
    return bounds
