"""Attention over a per-sequence KV cache, for flat batches that mix prefill and decode.

Tokens of all sequences in a step are concatenated: q is [tokens, heads/tp, head_dim].
The cache holds, per layer, k and v of shape [slots, kv_heads/tp, max_len, head_dim];
each sequence owns one slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    slots: torch.Tensor  # [seqs] cache slot of each sequence
    starts: torch.Tensor  # [seqs] tokens already in the cache before this step
    query_lens: list[int]  # new tokens per sequence, summing to the step's tokens
    positions: torch.Tensor  # [tokens] position of each token

    @classmethod
    def build(cls, slots: list[int], starts: list[int], query_lens: list[int]) -> "AttentionMetadata":
        positions = [torch.arange(s, s + n) for s, n in zip(starts, query_lens)]
        positions = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long)
        return cls(torch.tensor(slots, dtype=torch.long), torch.tensor(starts, dtype=torch.long),
                   list(query_lens), positions)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    def token_slots(self) -> torch.Tensor:
        return torch.repeat_interleave(self.slots, torch.tensor(self.query_lens, dtype=torch.long))


class KVCache:
    """Contiguous per-slot cache for one stage's layers."""

    def __init__(self, num_layers: int, slots: int, kv_heads: int, max_len: int, head_dim: int, dtype):
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.max_len = max_len


def write_cache(k_cache, v_cache, k, v, meta: AttentionMetadata) -> None:
    """k, v: [tokens, kv_heads, head_dim] stored at each token's slot and position."""
    slot = meta.token_slots()
    k_cache[slot, :, meta.positions] = k
    v_cache[slot, :, meta.positions] = v


def attend(q, k_cache, v_cache, meta: AttentionMetadata, *, sliding_window: int | None = None) -> torch.Tensor:
    """q: [tokens, heads, head_dim] -> [tokens, heads, head_dim], causal over cache + new tokens."""
    heads, kv_heads = q.shape[1], k_cache.shape[1]
    gqa = heads != kv_heads
    if not meta.query_lens:  # an idle DP replica still runs the layer (its MoE joins the collectives)
        return q
    if meta.is_decode:
        ctx = meta.starts + 1  # [seqs]
        length = int(ctx.max())
        k = k_cache[meta.slots, :, :length]  # [seqs, kv_heads, length, head_dim]
        v = v_cache[meta.slots, :, :length]
        keys = torch.arange(length)
        mask = keys[None, :] < ctx[:, None]
        if sliding_window:
            mask &= keys[None, :] > (ctx[:, None] - 1 - sliding_window)
        out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask[:, None, None, :], enable_gqa=gqa)
        return out[:, :, 0]
    outs, offset = [], 0
    for slot, start, n in zip(meta.slots.tolist(), meta.starts.tolist(), meta.query_lens):
        length = start + n
        qs = q[offset:offset + n].transpose(0, 1)[None]  # [1, heads, n, head_dim]
        k = k_cache[slot, :, :length][None]
        v = v_cache[slot, :, :length][None]
        pos = torch.arange(start, length)[:, None]
        keys = torch.arange(length)[None, :]
        mask = keys <= pos
        if sliding_window:
            mask &= keys > pos - sliding_window
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask[None, None], enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))
        offset += n
    return torch.cat(outs)
