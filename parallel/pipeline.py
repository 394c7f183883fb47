"""Pipeline stage split: contiguous layer ranges that balance per-stage cost.

Cost is the weight bytes a decode step reads, the binding resource of decode: each
decoder layer costs its parameters, the last stage also pays for the LM head (on small
models that is several layers' worth), and the embedding lookup reads only a few rows.
"""

from __future__ import annotations

from atoll.errors import LayoutError


def split_layers(num_layers: int, pp: int, *, layer_cost: float = 1.0, last_extra: float = 0.0,
                 first_extra: float = 0.0) -> list[tuple[int, int]]:
    """[(start, end)] per stage minimising the most expensive stage; every stage gets a layer."""
    if pp > num_layers:
        raise LayoutError(f"pp={pp} exceeds num_hidden_layers={num_layers}: every stage needs a layer")
    # best[s][n]: minimal max cost placing the first n layers on stages 0..s-1
    inf = float("inf")
    best = [[inf] * (num_layers + 1) for _ in range(pp + 1)]
    cut = [[0] * (num_layers + 1) for _ in range(pp + 1)]
    best[0][0] = 0.0
    for s in range(1, pp + 1):
        extra = (first_extra if s == 1 else 0.0) + (last_extra if s == pp else 0.0)
        for n in range(s, num_layers - (pp - s) + 1):
            for m in range(s - 1, n):
                cost = max(best[s - 1][m], (n - m) * layer_cost + extra)
                if cost < best[s][n] + 1e-12:  # on ties the later cut wins: earlier stages take more
                    best[s][n], cut[s][n] = cost, m
    bounds, n = [], num_layers
    for s in range(pp, 0, -1):
        m = cut[s][n]
        bounds.append((m, n))
        n = m
    return bounds[::-1]


def stage_layers(config, pp: int) -> list[tuple[int, int]]:
    """The split for a ModelConfig: LM head cost in units of one decoder layer's weights."""
    h, inter = config.hidden_size, config.intermediate_size or config.moe_intermediate_size
    attn = h * config.head_dim * (2 * config.num_attention_heads + 2 * config.num_key_value_heads)
    layer = attn + 3 * h * inter
    head = config.vocab_size * h
    return split_layers(config.num_hidden_layers, pp, last_extra=head / layer)
