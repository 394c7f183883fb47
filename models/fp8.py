"""fp8 block-quantized checkpoints, laid out as DeepSeek-V3's: config.json's
quantization_config says quant_method "fp8" and weight_block_size [128, 128]; each quantized
2-D weight is stored in float8 (e4m3) beside `<name>_scale_inv`, one fp32 scale per block of
128 x 128 elements (shape [ceil(rows/128), ceil(cols/128)]); the weight is fp8.float() times
its block's scale.

Fp8Source stands in for such a weight's checkpoint source, so the weight_loaders need no
change: indexing it reads only that slice of the fp8 weight and the scales of the blocks the
slice touches (a TP shard or an expert's moe_tp rows may start inside a block), and returns
the slice dequantized in float32; the loader casts it to the compute dtype as it copies.
"""

from __future__ import annotations

import torch

from atoll.errors import CheckpointError

FP8_DTYPES = ("F8_E4M3", "F8_E5M2")  # safetensors' names
SCALE_SUFFIX = "_scale_inv"


def block_size(raw: dict) -> tuple[int, int] | None:
    """(rows, cols) of a scale block from config.json's quantization_config, None when the
    checkpoint is not quantized; any other quantization is refused."""
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"config.json: quantization_config={str(q)[:40]!r} must be a JSON object")
    method = q.get("quant_method")
    if method != "fp8":
        raise CheckpointError(f"config.json: quantization_config.quant_method={method!r} is not supported; "
                              "atoll reads unquantized and fp8 block-quantized checkpoints")
    block = q.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"config.json: quantization_config.weight_block_size={block!r} must be two whole "
                              "numbers such as [128, 128] (fp8 with one scale per tensor is not supported)")
    return block[0], block[1]


def scale_of(name: str) -> str:
    return name + SCALE_SUFFIX


def weight_of(name: str) -> str | None:
    """The weight a scale tensor belongs to, None for any other name."""
    return name[: -len(SCALE_SUFFIX)] if name.endswith(SCALE_SUFFIX) else None


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
            raise CheckpointError(f"tensor {scale_of(name)} has shape {tuple(scale.shape)}; {name} of shape "
                                  f"{(rows, cols)} in blocks of {list(block)} needs {need}")
        self.name, self.weight, self.scale, self.block = name, weight, scale, block
        self.device = torch.device(device)

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
