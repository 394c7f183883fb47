"""The KV cache per attention kind: what one token holds in one layer on one TP rank, its
bytes, and the cache built from it. The runtime's cache (its block sizing, --kv-cache-gb,
--gpu-memory-utilization) and the planner's memory model both read these, so a figure is
computed once.

GQA: k and v, kv heads split over tp, at least one per rank (tp > kv_heads replicates them).
MLA: one latent vector of kv_lora_rank + qk_rope_head_dim, no head axis to split and no
separate v; every TP rank holds it whole (576 values a token for DeepSeek-V3).

A quantized cache (--kv-cache-dtype, layers/kv_quant.py) stores each value in its format's
bytes plus, for int8, a float32 scale per token and head: `kv_cache_dtype` names it here.
"""

from __future__ import annotations

from dataclasses import dataclass

from atoll.layers.attention import KVCache
from atoll.layers.kv_quant import kv_format
from atoll.parallel.pipeline import stage_layers


@dataclass(frozen=True)
class TokenShape:
    """One token in one layer on one rank: `heads` x `dim`, and a v of that shape too if `values`."""

    heads: int
    dim: int
    values: bool

    def bytes(self, itemsize: float, scale_bytes: float = 0) -> float:
        """itemsize per value, plus scale_bytes per head (a quantized cache's scale)."""
        return (2 if self.values else 1) * self.heads * (self.dim * itemsize + scale_bytes)


def gqa_shape(*, kv_heads: int, head_dim: int, tp: int) -> TokenShape:
    return TokenShape(heads=max(kv_heads // tp, 1), dim=head_dim, values=True)


def mla_shape(*, kv_latent: int) -> TokenShape:
    return TokenShape(heads=1, dim=kv_latent, values=False)


def token_shape(config, tp: int) -> TokenShape:
    """The shape for a ModelConfig's attention kind."""
    if config.is_mla:
        return mla_shape(kv_latent=config.kv_lora_rank + config.qk_rope_head_dim)
    return gqa_shape(kv_heads=config.num_key_value_heads, head_dim=config.head_dim, tp=tp)


def kv_bytes_per_token_layer(*, kv_heads: int, head_dim: int, tp: int, itemsize: float,
                             kv_latent: int = 0, scale_bytes: float = 0) -> float:
    """One token in one layer on one TP rank (the planner's Shapes call this): MLA when kv_latent > 0.
    scale_bytes: a quantized cache's scale bytes per token and head (storage_bytes)."""
    shape = mla_shape(kv_latent=kv_latent) if kv_latent else gqa_shape(kv_heads=kv_heads, head_dim=head_dim, tp=tp)
    return shape.bytes(itemsize, scale_bytes)


def storage_bytes(itemsize: float, kv_cache_dtype: str | None = "auto") -> tuple[float, float]:
    """(bytes per value, scale bytes per token and head) of a cache in `kv_cache_dtype`
    (auto: the compute dtype's itemsize, no scale)."""
    fmt = kv_format(kv_cache_dtype)
    return (itemsize, 0) if fmt is None else (fmt.itemsize, fmt.scale_bytes)


def kv_bytes_per_block(config, layout, itemsize: int, block_size: int, *, kv_cache_dtype: str = "auto") -> int:
    """One block of the largest pipeline stage's cache on one rank, in the compute dtype's
    itemsize or the quantized storage of kv_cache_dtype (values + scales)."""
    layers = max(end - start for start, end in stage_layers(config, layout.pp))
    return int(block_size * layers * token_shape(config, layout.tp).bytes(*storage_bytes(itemsize, kv_cache_dtype)))


def make_cache(config, tp: int, *, layers: int, blocks: int | list[int], block_size: int, dtype, device,
               kv_cache_dtype: str = "auto"):
    """The paged cache of `layers` layers on one rank (layers.attention.KVCache; keys only for MLA),
    quantized when kv_cache_dtype is not auto; blocks: every layer's count, or each layer's."""
    s = token_shape(config, tp)
    return KVCache(layers, blocks, s.heads, block_size, s.dim, dtype, device=device, values=s.values,
                   kv_format=kv_format(kv_cache_dtype))
