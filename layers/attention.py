"""Attention over a paged KV cache, for flat batches that mix prefill and decode.

Tokens of all sequences in a step are concatenated: q is [tokens, heads/tp, head_dim].
The cache holds, per layer, k and v of shape [blocks, block_size, kv_heads/tp, head_dim];
a sequence's block table lists the blocks holding its positions 0, bs, 2*bs, ...
A contiguous cache is the special case of one block of max_len per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass
class AttentionMetadata:
    block_tables: torch.Tensor  # [seqs, max blocks] block ids, padded with 0
    starts: torch.Tensor  # [seqs] tokens already in the cache before this step
    query_lens: list[int]  # new tokens per sequence, summing to the step's tokens
    positions: torch.Tensor  # [tokens] position of each token
    block_size: int
    _memo: dict = field(default_factory=dict, repr=False, compare=False)  # per step, shared by all layers

    @classmethod
    def build(cls, block_tables: list[list[int]], starts: list[int], query_lens: list[int],
              block_size: int) -> "AttentionMetadata":
        positions = [torch.arange(s, s + n) for s, n in zip(starts, query_lens)]
        positions = torch.cat(positions) if positions else torch.zeros(0, dtype=torch.long)
        width = max((len(t) for t in block_tables), default=0)
        tables = torch.zeros(len(block_tables), width, dtype=torch.long)
        for i, t in enumerate(block_tables):
            tables[i, : len(t)] = torch.tensor(t, dtype=torch.long)
        return cls(tables, torch.tensor(starts, dtype=torch.long), list(query_lens), positions, block_size)

    @classmethod
    def contiguous(cls, slots: list[int], starts: list[int], query_lens: list[int], max_len: int):
        """One block of max_len per sequence: slot i is block i."""
        return cls.build([[s] for s in slots], starts, query_lens, max_len)

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    def token_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) in the cache of every token of the step."""
        if "blocks" not in self._memo:
            seq = torch.repeat_interleave(torch.arange(len(self.query_lens)),
                                          torch.tensor(self.query_lens, dtype=torch.long))
            self._memo["blocks"] = (self.block_tables[seq, self.positions // self.block_size],
                                    self.positions % self.block_size)
        return self._memo["blocks"]

    def decode_keys(self, sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables cut to the longest context, key mask [seqs, keys]) of a decode step."""
        key = ("decode", sliding_window)
        if key not in self._memo:
            ctx = self.starts + 1  # [seqs]
            blocks = -(-int(ctx.max()) // self.block_size)
            keys = torch.arange(blocks * self.block_size)
            mask = keys[None, :] < ctx[:, None]
            if sliding_window:
                mask &= keys[None, :] > (ctx[:, None] - 1 - sliding_window)
            self._memo[key] = (self.block_tables[:, :blocks], mask[:, None, None, :])
        return self._memo[key]


class KVCache:
    """One stage's paged cache: per layer k and v of [blocks, block_size, kv_heads, head_dim]
    (a block's tokens side by side, so gathered blocks are one sequence's keys in order)."""

    def __init__(self, num_layers: int, num_blocks: int, kv_heads: int, block_size: int, head_dim: int, dtype):
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(num_layers)]
        self.block_size = block_size

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


def write_cache(k_cache, v_cache, k, v, meta: AttentionMetadata) -> None:
    """k, v: [tokens, kv_heads, head_dim] stored at each token's block and offset."""
    block, offset = meta.token_blocks()
    k_cache[block, offset] = k
    v_cache[block, offset] = v


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    """[seqs, blocks] tables -> [seqs, kv_heads, blocks*block_size, head_dim], a view of one
    copy (index_select: a fraction of advanced indexing's cost)."""
    s, b = tables.shape
    _, bs, h, d = cache.shape
    x = cache.index_select(0, tables.reshape(-1))  # [seqs*blocks, block_size, kv_heads, head_dim]
    return x.view(s, b * bs, h, d).transpose(1, 2)


def attend(q, k_cache, v_cache, meta: AttentionMetadata, *, sliding_window: int | None = None) -> torch.Tensor:
    """q: [tokens, heads, head_dim] -> [tokens, heads, head_dim], causal over cache + new tokens."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    gqa = heads != kv_heads
    if not meta.query_lens:  # an idle DP replica still runs the layer (its MoE joins the collectives)
        return q
    if meta.is_decode:
        tables, mask = meta.decode_keys(sliding_window)
        k = _gather(k_cache, tables)  # [seqs, kv_heads, length, head_dim]
        v = _gather(v_cache, tables)
        out = F.scaled_dot_product_attention(q[:, :, None], k, v, attn_mask=mask, enable_gqa=gqa)
        return out[:, :, 0]
    outs, offset = [], 0
    for i, (start, n) in enumerate(zip(meta.starts.tolist(), meta.query_lens)):
        length = start + n
        blocks = -(-length // meta.block_size)
        qs = q[offset:offset + n].transpose(0, 1)[None]  # [1, heads, n, head_dim]
        k = _gather(k_cache, meta.block_tables[i:i + 1, :blocks])[:, :, :length]
        v = _gather(v_cache, meta.block_tables[i:i + 1, :blocks])[:, :, :length]
        pos = torch.arange(start, length)[:, None]
        keys = torch.arange(length)[None, :]
        mask = keys <= pos
        if sliding_window:
            mask &= keys > pos - sliding_window
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask[None, None], enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))
        offset += n
    return torch.cat(outs)
