"""Prefill of prompts that start fresh: every sequence of the step brings the same number of
new tokens and has nothing cached before them (a batch of equal-length prompts, or the first
chunk of each). Their attention needs only this step's own keys and values, so it runs as
one batched causal attention, with no gather from the paged cache and no loop over the
sequences (the general path in layers.attention.attend does both)."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def fresh_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta, *,
                  sliding_window: int | None = None, scale: float | None = None) -> torch.Tensor | None:
    """q: [tokens, heads, head_dim], k, v: [tokens, kv_heads, head_dim] of the step (already
    written into the cache) -> [tokens, heads, head_dim], or None when the step is not such a
    prefill (decode, cached context, or prompts of different lengths)."""
    lens = getattr(meta, "query_lens", None)
    if not lens or meta.is_decode or any(meta.start_list) or len(set(lens)) != 1 or not len(q):
        return None
    seqs, length = len(lens), lens[0]
    heads, dim = q.shape[1:]
    qs, ks, vs = (t.view(seqs, length, t.shape[1], t.shape[2]).transpose(1, 2) for t in (q, k, v))
    gqa = qs.shape[1] != ks.shape[1]
    if sliding_window and sliding_window < length:
        pos = torch.arange(length, device=q.device)
        mask = (pos[None, :] <= pos[:, None]) & (pos[None, :] > pos[:, None] - sliding_window)
        out = F.scaled_dot_product_attention(qs, ks, vs, attn_mask=mask, scale=scale, enable_gqa=gqa)
    else:
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale, enable_gqa=gqa)
    return out.transpose(1, 2).reshape(seqs * length, heads, vs.shape[-1])
