"""A quantized KV cache layer: values stored in 8 bits, read back in the compute dtype.

--kv-cache-dtype (config.engine.KV_CACHE_DTYPES, vLLM's spelling) picks the storage:

    auto      the compute dtype, no quantization (a plain tensor per layer)
    fp8       = fp8_e4m3: float8_e4m3fn, values clamped to +-448, no scale
    fp8_e5m2  float8_e5m2, clamped to +-57344, no scale
    int8      int8 with a float32 scale per (block, offset, kv head): scale = amax(|x|) / 127
              over the head's head_dim values, q = round(x / scale)

Why these granularities: fp8 is a float format, so its relative error (2**-4 for e4m3, 2**-3
for e5m2) does not depend on a scale as long as the values sit inside its range; attention
keys and values do (SmolLM2-135M's largest |k| is far below 448), so fp8 stores 1 byte a
value and nothing else, vLLM's default (a per-tensor scale of 1). int8 is a fixed-point
format: without a scale per small group its error follows the largest value of the tensor,
so each token's head vector carries its own scale, 4 bytes per head_dim values (68 bytes
instead of 64 for head_dim 64: 1.88x fewer bytes than bf16, 3.76x fewer than float32). The
measured effect (perplexity, greedy agreement) is in the manual's Quantization page (docs/quantization.md).

One layer's k (or v) is a QuantizedKV: `data` [blocks, block_size, kv_heads, head_dim] in the
storage dtype and `scale` [blocks, block_size, kv_heads] float32 (None for fp8). Writes
quantize (`store`), reads dequantize the gathered blocks (`select`); the Triton decode kernel
reads data and scale in place instead (kernels/triton_paged_attention.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atoll.config.engine import KV_CACHE_DTYPES, KV_STORAGE

SCALE_DTYPE = torch.float32


@dataclass(frozen=True)
class KVFormat:
    name: str
    storage: torch.dtype
    scaled: bool  # a SCALE_DTYPE scale per (block, offset, kv head)

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    @property
    def scale_bytes(self) -> int:
        """Bytes of scale per token and kv head (0: unscaled)."""
        return SCALE_DTYPE.itemsize if self.scaled else 0


FORMATS = {
    "fp8": KVFormat("fp8_e4m3", torch.float8_e4m3fn, False),
    "fp8_e4m3": KVFormat("fp8_e4m3", torch.float8_e4m3fn, False),
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, False),
    "int8": KVFormat("int8", torch.int8, True),
}
assert set(FORMATS) | {"auto"} == set(KV_CACHE_DTYPES)
assert all(KV_STORAGE[n] == (f.itemsize, f.scale_bytes) for n, f in FORMATS.items())  # the sizing's table
INT8_MAX = 127.0


def kv_format(name: str | None) -> KVFormat | None:
    """The storage of a --kv-cache-dtype name; None for auto (the compute dtype)."""
    return None if name in (None, "auto") else FORMATS[name]


def quantize(x: torch.Tensor, fmt: KVFormat) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [..., dim] -> (q [..., dim] in fmt.storage, scale [...] float32 or None)."""
    x = x.float()
    if fmt.scaled:
        scale = (x.abs().amax(dim=-1) / INT8_MAX).clamp_min(torch.finfo(SCALE_DTYPE).tiny)
        q = torch.round(x / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(fmt.storage)
        return q, scale
    top = torch.finfo(fmt.storage).max
    return x.clamp(-top, top).to(fmt.storage), None


def dequantize(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize, in `dtype` (products in float32)."""
    x = q.float()
    if scale is not None:
        x = x * scale[..., None]
    return x.to(dtype)


class QuantizedKV:
    """One layer's k or v cache stored in a KVFormat; `dtype` is the compute dtype reads return."""

    def __init__(self, shape: tuple[int, int, int, int], fmt: KVFormat, dtype: torch.dtype, *, device="cpu"):
        self.format, self.dtype = fmt, dtype
        self.data = torch.zeros(shape, dtype=fmt.storage, device=device)
        self.scale = torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=device) if fmt.scaled else None

    @property
    def shape(self) -> torch.Size:
        return self.data.shape

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def is_cuda(self) -> bool:
        return self.data.is_cuda

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.data, self.scale) if t is not None]

    def store(self, block: torch.Tensor, offset: torch.Tensor, x: torch.Tensor) -> None:
        """x: [tokens, kv_heads, head_dim] written, quantized, at each token's (block, offset)."""
        q, scale = quantize(x, self.format)
        self.data[block, offset] = q
        if scale is not None:
            self.scale[block, offset] = scale

    def select(self, ids: torch.Tensor) -> torch.Tensor:
        """Blocks `ids` dequantized: [len(ids), block_size, kv_heads, head_dim] in self.dtype."""
        scale = None if self.scale is None else self.scale.index_select(0, ids)
        return dequantize(self.data.index_select(0, ids), scale, self.dtype)
