"""A quantized KV cache layer: values stored in 8 bits, read back in the compute dtype.

--kv-cache-dtype (config.engine.KV_CACHE_DTYPES, vLLM's spelling) picks the storage:

    auto      the compute dtype, no quantization (a plain tensor per layer)
    fp8       = fp8_e4m3: float8_e4m3fn with a fixed scale per layer and kv head (a power of
              two), and a fixed "sink" per layer, kv head and channel: a sequence's first
              token is stored as its key (value) minus the sink, and read back plus it
    fp8_e5m2  float8_e5m2, clamped to +-57344, no scale
    int8      int8 with a float32 scale per (block, offset, kv head): scale = amax(|x|) / 127
              over the head's head_dim values, q = round(x / scale)

Why the sink. fp8 e4m3 (3 mantissa bits) has a relative error of at most 2**-4 wherever a
value sits in its normal range: a scale does not make it smaller, it only keeps values out of
the subnormals and below 448. Where that error hurts is the first token of every sequence:
the models put most of each head's attention there (an "attention sink"), with scores far above
the others, so 1/16 of that key moves every query's attention. Its key and value are nearly the
same whatever the token (SmolLM2-135M: the first positions' keys differ by at most 0.08 across
texts where they reach 4.5), so a fixed sink per layer and head, subtracted before quantizing
position 0 and added back on reading it, leaves almost nothing of them to round. Measured on
SmolLM2 (docs/quantization.md): fp8 with a scale per head and no sink moves perplexity by
+0.5% to +1.6% over three texts; keeping only the first token exact brings it to +0.04% to
+0.22%, as the sink does. A centre subtracted from every key, which softmax would not even see
(q.(k - c) moves every score of a query alike), measured no better: the keys' mean moves with
the text by more than its rounding error. The scale per kv head against one per layer changed
nothing beyond the noise; per head needs no agreement between TP ranks, which hold whole heads.

Scales are powers of two (rounded up): x / scale and q * scale are exact in every dtype, so the
torch paths (float32 or bf16) and the Triton kernels (float32 in the tile) read the same key and
value. Scale 1 and a zero sink is vLLM's default (no scales known: the run says so); a
checkpoint's k_scale/v_scale or `atoll calibrate-kv`'s file (models/kv_scales.py) sets them, or
--calculate-kv-scales fits them on the first prefill: the scale amax/200 for keys and
amax/100 for values (vLLM's rule), the sink the mean of the step's first-position tokens.
MLA's latent cache (key and value at once) takes the scale and no sink. int8 is fixed-point:
each token's head vector carries its own scale, 4 bytes per head_dim values.

One layer's k (or v) is a QuantizedKV: `data` [blocks, block_size, kv_heads, head_dim] in the
storage dtype; int8's `scale` [blocks, block_size, kv_heads] float32; fp8 e4m3's `head_scale`
[kv_heads] and `sink` [kv_heads, head_dim] (float32). Writes quantize (`store`, told which rows
are a sequence's position 0); reads dequantize the gathered blocks (`select`) and whoever knows
where position 0 is adds the sink (layers/attention.gather_blocks); the Triton kernels read data,
scale and sink in place (`kernel_scale`: e4m3's head scale as a view with strides (0, 0, 1)).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import torch

from atoll.config.engine import KV_CACHE_DTYPES, KV_STORAGE

SCALE_DTYPE = torch.float32
INT8_MAX = 127.0
# --calculate-kv-scales: the first prefill's amax maps to these (vLLM's K_SCALE_CONSTANT and
# V_SCALE_CONSTANT), leaving 2.2x and 4.5x of e4m3's 448 for later prompts; MLA's latent is a key
FIRST_PREFILL_RANGE = {"k": 200.0, "v": 100.0, "latent": 200.0}
# atoll calibrate-kv: a whole text's amax maps to at most this (2x under 448 before the power of two)
CALIBRATED_RANGE = 224.0


@dataclass(frozen=True)
class KVFormat:
    name: str
    storage: torch.dtype
    scaled: bool  # a SCALE_DTYPE scale per (block, offset, kv head)
    static: bool = False  # a fixed scale per kv head and a sink per kv head and channel (e4m3)

    @property
    def itemsize(self) -> int:
        return self.storage.itemsize

    @property
    def scale_bytes(self) -> int:
        """Bytes of scale per token and kv head (0: none per token)."""
        return SCALE_DTYPE.itemsize if self.scaled else 0


E4M3 = KVFormat("fp8_e4m3", torch.float8_e4m3fn, False, True)
FORMATS = {
    "fp8": E4M3,
    "fp8_e4m3": E4M3,
    "fp8_e5m2": KVFormat("fp8_e5m2", torch.float8_e5m2, False),
    "int8": KVFormat("int8", torch.int8, True),
}
assert set(FORMATS) | {"auto"} == set(KV_CACHE_DTYPES)
assert all(KV_STORAGE[n] == (f.itemsize, f.scale_bytes) for n, f in FORMATS.items())  # the sizing's table


def kv_format(name: str | None) -> KVFormat | None:
    """The storage of a --kv-cache-dtype name; None for auto (the compute dtype)."""
    return None if name in (None, "auto") else FORMATS[name]


def power_of_two_above(x: torch.Tensor) -> torch.Tensor:
    """The least power of two >= x (x > 0), exactly: frexp's x = m * 2**e, m in [0.5, 1)."""
    m, e = torch.frexp(x.float())
    return torch.ldexp(torch.ones_like(m), e - (m == 0.5).to(e.dtype))


def fit_scale(amax: torch.Tensor, top: float) -> torch.Tensor:
    """[heads] amax -> [heads] scales: amax / top rounded up to a power of two (1 where amax is 0)."""
    amax = amax.float()
    return torch.where(amax > 0, power_of_two_above(amax.clamp_min(1e-30) / top), torch.ones_like(amax))


def quantize(x: torch.Tensor, fmt: KVFormat,
             head_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x: [..., kv_heads, dim] -> (q [..., kv_heads, dim] in fmt.storage, int8's scale [..., kv_heads]
    float32 or None). head_scale [kv_heads]: e4m3's (None: 1)."""
    x = x.float()
    if fmt.scaled:
        scale = (x.abs().amax(dim=-1) / INT8_MAX).clamp_min(torch.finfo(SCALE_DTYPE).tiny)
        q = torch.round(x / scale[..., None]).clamp_(-INT8_MAX, INT8_MAX).to(fmt.storage)
        return q, scale
    if head_scale is not None:
        x = x / head_scale[:, None]  # a power of two: exact
    top = torch.finfo(fmt.storage).max
    return x.clamp(-top, top).to(fmt.storage), None


def dequantize(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The inverse of quantize, in `dtype` (products in float32): scale is int8's [..., kv_heads]
    or e4m3's [kv_heads]; a first position's sink is added by whoever knows the position."""
    x = q.float()
    if scale is not None:
        x = x * scale[..., None]
    return x.to(dtype)


class QuantizedKV:
    """One layer's k or v cache stored in a KVFormat; `dtype` is the compute dtype reads return.
    role: "k", "v" or "latent" (MLA's vector, key and value at once: a scale and no sink)."""

    def __init__(self, shape: tuple[int, int, int, int], fmt: KVFormat, dtype: torch.dtype, *, device="cpu",
                 role: str = "k"):
        self.format, self.dtype, self.role = fmt, dtype, role
        self.data = torch.zeros(shape, dtype=fmt.storage, device=device)
        self.scale = torch.zeros(shape[:3], dtype=SCALE_DTYPE, device=device) if fmt.scaled else None
        heads, dim = shape[2], shape[3]
        self.head_scale = torch.ones(heads, dtype=SCALE_DTYPE, device=device) if fmt.static else None
        self.sink = torch.zeros(heads, dim, dtype=SCALE_DTYPE, device=device) \
            if fmt.static and role != "latent" else None
        self.pending = False  # True: the first store fits head_scale and sink (--calculate-kv-scales)

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
        """The per-block planes (values, int8's scales): what a block's bytes are."""
        return [t for t in (self.data, self.scale) if t is not None]

    def static_tensors(self) -> list[torch.Tensor]:
        """The fixed scale and sink (e4m3): a few bytes per layer, the same for every block."""
        return [t for t in (self.head_scale, self.sink) if t is not None]

    def set_static(self, scale, sink=None) -> None:
        """Fixed e4m3 scales [kv_heads] (rounded up to powers of two) and sinks [kv_heads, head_dim]
        (None: 0)."""
        self.head_scale.copy_(power_of_two_above(torch.as_tensor(scale, dtype=SCALE_DTYPE)))
        if self.sink is not None:
            self.sink.copy_(torch.as_tensor(sink, dtype=SCALE_DTYPE) if sink is not None else 0.0)
        self.pending = False

    def store(self, block: torch.Tensor, offset: torch.Tensor, x: torch.Tensor, *, first: torch.Tensor | None = None,
              agree=None, read_back: bool = False, fit: bool = True) -> torch.Tensor | None:
        """x: [tokens, kv_heads, head_dim] written, quantized, at each token's (block, offset);
        first: [tokens] bool, the rows that are a sequence's position 0 (stored minus the sink).
        read_back: return the values attention reads for them ([tokens, kv_heads, head_dim] in
        self.dtype, the sink added back). agree(tensor, op): context parallelism's all_reduce, for
        a fit (every cp rank computes a share of the tokens); fit: whether this store may fit pending scales
        (False in the static decode step: layers.attention.write_cache)."""
        if fit and self.pending and (agree is not None or len(x)):  # fit first: a decode step (traced) never reads pending
            self.fit(x, first, agree)
        sink = None if self.sink is None or first is None else first[:, None, None] * self.sink  # [tokens, h, d]
        q, scale = quantize(x if sink is None else x.float() - sink, self.format, self.head_scale)
        self.data[block, offset] = q
        if scale is not None:
            self.scale[block, offset] = scale
        if not read_back:
            return None
        back = dequantize(q, scale if scale is not None else self.head_scale, torch.float32)
        return (back if sink is None else back + sink).to(self.dtype)

    def fit(self, x: torch.Tensor, first: torch.Tensor | None, agree=None) -> None:
        """--calculate-kv-scales: head_scale and sink from these tokens, the first this cache
        stores: the scale the head's largest |x| over FIRST_PREFILL_RANGE, the sink the mean of
        the rows at position 0. agree: maxima and sums over the cp group."""
        x = x.float()
        heads, dim = x.shape[1:]
        amax = x.abs().amax(dim=(0, 2)) if len(x) else x.new_zeros(heads)
        firsts = x[first] if first is not None else x[:0]
        sums = torch.cat([firsts.sum(dim=0).reshape(-1), x.new_tensor([len(firsts), len(x)])])
        if agree is not None:
            amax, sums = agree(amax, "max"), agree(sums, "sum")
        if sums[-1] == 0:  # no rank had a token: wait for the next store
            return
        sink = (sums[:-2] / sums[-2].clamp_min(1)).view(heads, dim) if self.sink is not None else None
        self.set_static(fit_scale(amax, FIRST_PREFILL_RANGE[self.role]), sink)

    def select(self, ids: torch.Tensor) -> torch.Tensor:
        """Blocks `ids` dequantized: [len(ids), block_size, kv_heads, head_dim] in self.dtype
        (position 0 without its sink: gather_blocks adds it)."""
        scale = self.head_scale if self.scale is None else self.scale.index_select(0, ids)
        return dequantize(self.data.index_select(0, ids), scale, self.dtype)

    def kernel_scale(self) -> torch.Tensor | None:
        """The scale the Triton kernels read per (block, offset, kv head): int8's plane, or e4m3's
        head scale expanded to that shape without a copy (strides 0, 0, 1); None for e5m2."""
        if self.scale is not None:
            return self.scale
        return None if self.head_scale is None else self.head_scale.expand(self.data.shape[:3])


def static_digest(layers) -> str:
    """A digest of QuantizedKVs' fixed scales and sinks (the KV tiers' namespace: a block stored
    under one scale must never be read under another); "" without any, "pending" before a fit."""
    layers = [x for x in layers if isinstance(x, QuantizedKV) and x.head_scale is not None]
    if not layers:
        return ""
    if any(x.pending for x in layers):
        return "pending"
    h = hashlib.blake2b(digest_size=16)
    for x in layers:
        for t in x.static_tensors():
            h.update(t.detach().cpu().numpy().tobytes())
    return h.hexdigest()
