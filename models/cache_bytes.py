"""KV cache bytes, one function per attention kind, shared by the runtime's cache sizing and
the planner's memory model (a figure is computed once)."""

from __future__ import annotations


def kv_bytes_per_token_layer(*, kv_heads: int, head_dim: int, tp: int, itemsize: float,
                             kv_latent: int = 0) -> float:
    """One token in one layer on one TP rank. GQA: k and v, heads split over tp, at least one
    per rank (tp > kv_heads replicates them). MLA (kv_latent > 0): one latent vector, not split."""
    if kv_latent:
        return kv_latent * itemsize
    return 2 * max(kv_heads // tp, 1) * head_dim * itemsize


def kv_bytes_per_block(config, layout, itemsize: int, block_size: int) -> int:
    """One block of the largest pipeline stage's cache on one rank."""
    from atoll.parallel.pipeline import stage_layers

    layers = max(end - start for start, end in stage_layers(config, layout.pp))
    per = kv_bytes_per_token_layer(kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                                   tp=layout.tp, itemsize=itemsize)
    return int(block_size * layers * per)
