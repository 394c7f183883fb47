"""Attention over a paged KV cache, for flat batches that mix prefill and decode.

Tokens of all sequences in a step are concatenated: q is [tokens, heads/tp, head_dim].
The cache holds, per layer, k and v of shape [blocks, block_size, kv_heads/tp, head_dim];
a sequence's block table lists the blocks holding its positions 0, bs, 2*bs, ...
A contiguous cache is the special case of one block of max_len per sequence.
A quantized cache (--kv-cache-dtype, layers/kv_quant.py) holds a QuantizedKV per layer instead
of a tensor: write_cache quantizes, gather_blocks dequantizes the blocks it reads.

Every attention over a quantized cache reads the keys and values as stored (quantized, then
read back), the step's own new tokens included: a prompt prefilled alone (layers/prefill.py,
from write_cache's read-back), beside others, in chunks or over a prefix-cache hit (the
blocks gathered here, or read in place by the Triton kernels) attends to the same values, so
its tokens do not depend on what else the step holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from atoll.kernels.backend import use_triton
from atoll.kernels.ops import paged_decode_attention, paged_prefill_attention
from atoll.layers.context_groups import context_groups
from atoll.layers.kv_quant import KVFormat, QuantizedKV, static_digest


@dataclass
class AttentionMetadata:
    """One step's positions and cache addresses, built once on the host from the scheduler's
    lists and copied to the rank's device in one go per tensor; the host lists stay for
    lengths, so no layer reads a device tensor back."""

    block_tables: torch.Tensor  # [seqs, max blocks] block ids, padded with 0
    starts: torch.Tensor  # [seqs] tokens already in the cache before this step
    query_lens: list[int]  # new tokens per sequence, summing to the step's tokens
    positions: torch.Tensor  # [tokens] position of each token
    block_size: int
    start_list: list[int] = field(default_factory=list)  # starts, on the host
    slots: tuple[torch.Tensor, torch.Tensor] | None = None  # (block, offset) of every new token
    _memo: dict = field(default_factory=dict, repr=False, compare=False)  # per step, shared by all layers
    # the same step over the sliding layers' own block tables, when they keep their own cache
    # (engine.kv.windowed: tables with a `window` list); None when every layer reads these tables
    windowed: "AttentionMetadata | None" = None
    # a tree verify step (engine.sample.tree): [rows, keys] the keys each decode row reads, in
    # place of the causal mask (its context, then its ancestors and itself); None: causal
    visible: torch.Tensor | None = None

    @classmethod
    def build(cls, block_tables: list[list[int]], starts: list[int], query_lens: list[int],
              block_size: int, *, device="cpu") -> "AttentionMetadata":
        positions, blocks, offsets = [], [], []
        for table, s, n in zip(block_tables, starts, query_lens):
            for p in range(s, s + n):
                positions.append(p)
                blocks.append(table[p // block_size])
                offsets.append(p % block_size)
        width = max((len(t) for t in block_tables), default=0)
        flat = [b for t in block_tables for b in (*t, *[0] * (width - len(t)))]
        parts = (len(flat), len(blocks), len(offsets), len(starts), len(positions))
        flat += blocks + offsets + list(starts) + positions
        # one host-to-device copy for the step (each copy to a GPU costs a round trip), then views
        tables, block, offset, start, pos = torch.tensor(flat, dtype=torch.long, device=device).split(parts)
        windowed = None
        if block_tables and hasattr(block_tables[0], "window"):
            windowed = cls.build([t.window for t in block_tables], starts, query_lens, block_size, device=device)
        return cls(tables.view(len(block_tables), width), start, list(query_lens), pos, block_size, list(starts),
                   (block, offset), windowed=windowed)

    @classmethod
    def contiguous(cls, slots: list[int], starts: list[int], query_lens: list[int], max_len: int, *, device="cpu"):
        """One block of max_len per sequence: slot i is block i."""
        return cls.build([[s] for s in slots], starts, query_lens, max_len, device=device)

    @property
    def device(self) -> torch.device:
        return self.positions.device

    @property
    def is_decode(self) -> bool:
        return all(n == 1 for n in self.query_lens)

    def token_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(block, offset) in the cache of every token of the step."""
        return self.slots

    def last_tokens(self) -> torch.Tensor:
        """[seqs] index of each sequence's last new token in the step's flat batch."""
        if "last" not in self._memo:
            ends, total = [], 0
            for n in self.query_lens:
                total += n
                ends.append(total - 1)
            self._memo["last"] = torch.tensor(ends, dtype=torch.long, device=self.device)
        return self._memo["last"]

    def context_lens(self) -> torch.Tensor:
        """[seqs] keys each decoding sequence attends to, its new token included."""
        if "context" not in self._memo:
            self._memo["context"] = self.starts + 1
        return self._memo["context"]

    def query_starts(self) -> torch.Tensor:
        """[seqs + 1] offset of each sequence's first new token in the step's flat batch, then
        the step's token count."""
        if "query_starts" not in self._memo:
            bounds = [0]
            for n in self.query_lens:
                bounds.append(bounds[-1] + n)
            self._memo["query_starts"] = torch.tensor(bounds, dtype=torch.long, device=self.device)
        return self._memo["query_starts"]

    def decode_keys(self, sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """(block tables cut to the longest context, key mask [seqs, keys]) of a decode step."""
        key = ("decode", sliding_window)
        if key not in self._memo:
            blocks = -(-(max(self.start_list) + 1) // self.block_size)
            mask = key_mask(self.context_lens(), blocks * self.block_size, sliding_window)
            if self.visible is not None:
                mask = mask & self.visible[:, None, None, :blocks * self.block_size]
            self._memo[key] = (self.block_tables[:, :blocks], mask)
        return self._memo[key]

    def decode_groups(self, sliding_window: int | None) -> list[tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]]:
        """A decode step's rows in groups of similar context (layers.context_groups), each
        (rows or None for all, block tables cut to the group's longest context, key mask)."""
        key = ("groups", sliding_window)
        if key not in self._memo:
            # a tree step's rows read their own ancestors (visible): one group
            split = None if self.visible is not None else context_groups(self.start_list, self.block_size)
            if split is None:
                self._memo[key] = [(None, *self.decode_keys(sliding_window))]
            else:
                lens, groups = self.context_lens(), []
                for rows in split:
                    blocks = -(-(max(self.start_list[i] for i in rows) + 1) // self.block_size)
                    index = torch.tensor(rows, dtype=torch.long, device=self.device)
                    groups.append((index, self.block_tables[index, :blocks],
                                   key_mask(lens[index], blocks * self.block_size, sliding_window)))
                self._memo[key] = groups
        return self._memo[key]


def decode_attention(q: torch.Tensor, groups, attend_group) -> torch.Tensor:
    """q: [seqs, heads, dim] -> attend_group(q_rows, tables, mask) for each of decode_groups'
    groups, the rows put back in order: [seqs, heads, out dim]."""
    if len(groups) == 1:
        return attend_group(q, *groups[0][1:])
    out = None
    for rows, tables, mask in groups:
        o = attend_group(q.index_select(0, rows), tables, mask)
        if out is None:
            out = o.new_empty(q.shape[0], *o.shape[1:])
        out.index_copy_(0, rows, o)
    return out


def key_mask(lengths: torch.Tensor, keys: int, sliding_window: int | None) -> torch.Tensor:
    """[seqs, 1, 1, keys]: which of a decoding sequence's first `keys` cache positions its new
    token attends to (those before its length, and within the window when there is one)."""
    at = torch.arange(keys, device=lengths.device)[None, :]
    ctx = lengths[:, None]
    mask = at < ctx
    if sliding_window:
        mask &= at > ctx - 1 - sliding_window
    return mask[:, None, None, :]


@dataclass
class StaticDecode:
    """A decode step padded to a bucket, as tensors only: what the compiled decode step
    (engine.step.compiled) reads. Rows past the real sequences are padding: they write into a
    scratch block and attend to it alone, so every row stays finite and no real row sees them."""

    positions: torch.Tensor  # [seqs] position of each sequence's new token
    slots: tuple[torch.Tensor, torch.Tensor]  # (block, offset) of each new token
    block_tables: torch.Tensor  # [seqs, blocks] (blocks: a bucket, padded past each context)
    lengths: torch.Tensor  # [seqs] keys each sequence attends to, its new token included
    block_size: int
    is_decode = True

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def token_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.slots

    def context_lens(self) -> torch.Tensor:
        return self.lengths

    def decode_keys(self, sliding_window: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        """Every block of the tables, keys past each context masked: no shape depends on the data."""
        return self.block_tables, key_mask(self.lengths, self.block_tables.shape[1] * self.block_size,
                                           sliding_window)

    def decode_groups(self, sliding_window: int | None) -> list:
        """One group of every row: a captured step's shapes cannot depend on the data."""
        return [(None, *self.decode_keys(sliding_window))]


class KVCache:
    """One stage's paged cache: per layer k and v of [blocks, block_size, kv_heads, head_dim]
    (a block's tokens side by side, so gathered blocks are one sequence's keys in order).
    values=False: keys only, v holds None per layer (MLA's latent cache: kv_heads 1, head_dim
    kv_lora_rank + qk_rope_head_dim, its values a slice of the same vector).
    kv_format: quantized storage (layers/kv_quant.py), each layer's k and v a QuantizedKV
    whose reads return `dtype`; None: plain tensors of `dtype`. fp8 e4m3's fixed scales:
    `scales`, one (k scales, v scales or None, k sink, v sink) per layer of this rank
    ([kv_heads], [kv_heads], [kv_heads, head_dim] each or None; None: scale 1, sink 0), or
    fit_first: each layer fits its own on its first store (--calculate-kv-scales)."""

    def __init__(self, num_layers: int, num_blocks: int | list[int], kv_heads: int, block_size: int, head_dim: int,
                 dtype, *, device="cpu", values: bool = True, kv_format: KVFormat | None = None,
                 scales: list | None = None, fit_first: bool = False):
        """num_blocks: every layer's, or a list of each layer's (a sliding layer keeping fewer:
        engine.kv.windowed); self.num_blocks is the largest."""
        counts = num_blocks if isinstance(num_blocks, list) else [num_blocks] * num_layers

        def one(blocks, role):
            shape = (blocks, block_size, kv_heads, head_dim)
            if kv_format is not None:
                return QuantizedKV(shape, kv_format, dtype, device=device, role=role)
            return torch.zeros(shape, dtype=dtype, device=device)

        self.k = [one(n, "k" if values else "latent") for n in counts]
        self.v = [one(n, "v") if values else None for n in counts]
        self.block_size = block_size
        self.num_blocks = max(counts, default=0)
        self.layer_blocks = counts
        self.kv_format = kv_format
        static = [x for x in self.k + self.v if isinstance(x, QuantizedKV) and x.head_scale is not None]
        if scales is not None and static:
            for k, v, (ks, vs, k_sink, v_sink) in zip(self.k, self.v, scales, strict=True):
                k.set_static(ks, k_sink)
                if v is not None:
                    v.set_static(vs, v_sink)
        for x in static:
            x.pending = fit_first
        self._pending = bool(static) and fit_first

    @property
    def pending(self) -> bool:
        """Whether a layer still waits for its first store to fit its scales (--calculate-kv-scales)."""
        if self._pending:  # once every layer has fitted, it stays so
            self._pending = any(isinstance(x, QuantizedKV) and x.pending for x in self.k + self.v)
        return self._pending

    def static_tensors(self) -> list[torch.Tensor]:
        """fp8 e4m3's fixed scales and sinks, every layer's (a few bytes each)."""
        return [t for x in self.k + self.v if isinstance(x, QuantizedKV) for t in x.static_tensors()]

    @property
    def static_bytes(self) -> int:
        """Bytes of the fixed scales and sinks (engine.kv.sizing.static_scale_bytes charges them)."""
        return sum(t.numel() * t.element_size() for t in self.static_tensors())

    def scales_digest(self) -> str:
        """A digest of the fixed scales and sinks ("" for a cache without)."""
        return static_digest(self.k + self.v)

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor the cache stores, in a fixed order (each layer's k, then each layer's v;
        a quantized one's values and scales), each [blocks, ...]."""
        out = []
        for t in self.k + self.v:
            out += t.tensors() if isinstance(t, QuantizedKV) else [] if t is None else [t]
        return out

    @property
    def bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token takes in every layer of this stage on this rank."""
        return sum(t.numel() * t.element_size() // (n * self.block_size)
                   for ts, n in zip(zip(self.k, self.v), self.layer_blocks)
                   for x in ts if x is not None
                   for t in (x.tensors() if isinstance(x, QuantizedKV) else [x]))


def write_cache(k_cache, v_cache, k, v, meta: AttentionMetadata):
    """k, v: [tokens, kv_heads, head_dim] stored at each token's block and offset (v_cache
    None: a keys-only cache; a QuantizedKV quantizes them). Returns (k, v) as attention reads
    them back: a quantized cache's stored values on a step that is not a decode (a prefill
    attending to its own new tokens reads these), else k and v as given. Under context
    parallelism a fit of the scales agrees over the cp group (meta.agree)."""
    block, offset = meta.token_blocks()
    read_back = not meta.is_decode
    agree = getattr(meta, "agree", None)
    first = meta.positions == 0 if getattr(k_cache, "sink", None) is not None else None  # position 0: the sink's
    out = []
    for cache, x in ((k_cache, k), (v_cache, v)):
        if isinstance(cache, QuantizedKV):
            # --calculate-kv-scales fits on the first eager step, never inside the static decode step
            # the CPU compiles and CUDA captures (its warm-up's scratch rows must not fit them; the
            # runner takes that step only once every layer has fitted)
            back = cache.store(block, offset, x, first=first, agree=agree, read_back=read_back,
                               fit=not isinstance(meta, StaticDecode))
            out.append(x if back is None else back)
            continue
        if cache is not None:
            cache[block, offset] = x
        out.append(x)
    return out[0], out[1]


def reads_in_place(q: torch.Tensor, cache) -> bool:
    """Whether attention over this quantized cache runs the Triton kernels, which read the stored
    bytes in place: then every prefill takes them (layers/prefill.py steps aside), one path."""
    return isinstance(cache, QuantizedKV) and use_triton(q, cache)


def read_blocks(cache, ids: torch.Tensor) -> torch.Tensor:
    """Blocks `ids` of a layer's cache: [len(ids), block_size, kv_heads, head_dim] in the compute
    dtype (a QuantizedKV dequantizes them)."""
    return cache.select(ids) if isinstance(cache, QuantizedKV) else cache.index_select(0, ids)


def gather_blocks(cache: torch.Tensor, tables: torch.Tensor, *, first: bool = True) -> torch.Tensor:
    """[seqs, blocks] tables -> [seqs, kv_heads, blocks*block_size, head_dim], a view of one
    copy (index_select: a fraction of advanced indexing's cost). first: the tables start at each
    sequence's block 0, whose position 0 takes an fp8 cache's sink back (layers/kv_quant.py;
    context parallelism's other ranks hold later blocks: False)."""
    s, b = tables.shape
    _, bs, h, d = cache.shape
    x = read_blocks(cache, tables.reshape(-1)).view(s, b * bs, h, d)  # one copy of the blocks
    sink = getattr(cache, "sink", None)
    if first and sink is not None and s:  # in float32, one rounding: as QuantizedKV.store's read-back
        x[:, 0] = (x[:, 0].float() + sink).to(x.dtype)
    return x.transpose(1, 2)


def attend(q, k_cache, v_cache, meta: AttentionMetadata, *, sliding_window: int | None = None,
           scale: float | None = None) -> torch.Tensor:
    """q: [tokens, heads, head_dim] -> [tokens, heads, head_dim], causal over cache + new tokens.
    meta: AttentionMetadata, or StaticDecode (the compiled decode step's). scale: the softmax
    scale (default head_dim**-0.5)."""
    heads, kv_heads = q.shape[1], k_cache.shape[2]
    gqa = heads != kv_heads
    if q.shape[0] == 0:  # an idle DP replica still runs the layer (its MoE joins the collectives)
        return q
    if use_triton(q, k_cache) and getattr(meta, "visible", None) is None:  # reads the paged cache in place
        quantized = isinstance(k_cache, QuantizedKV)
        kv = (k_cache.data, v_cache.data) if quantized else (k_cache, v_cache)
        scales = dict(k_scale=k_cache.kernel_scale(), v_scale=v_cache.kernel_scale(), k_sink=k_cache.sink,
                      v_sink=v_cache.sink) if quantized else {}
        if meta.is_decode:
            return paged_decode_attention(q, *kv, meta.block_tables, meta.context_lens(),
                                          sliding_window=sliding_window, scale=scale, **scales)
        return paged_prefill_attention(q, *kv, meta.block_tables, meta.query_starts(), meta.starts,
                                       max_query_len=max(meta.query_lens), sliding_window=sliding_window,
                                       scale=scale, **scales)
    if meta.is_decode:
        def group(qs, tables, mask):
            k = gather_blocks(k_cache, tables)  # [seqs, kv_heads, length, head_dim]
            v = gather_blocks(v_cache, tables)
            return F.scaled_dot_product_attention(qs[:, :, None], k, v, attn_mask=mask, scale=scale,
                                                  enable_gqa=gqa)[:, :, 0]

        return decode_attention(q, meta.decode_groups(sliding_window), group)
    outs, offset = [], 0
    for i, (start, n) in enumerate(zip(meta.start_list, meta.query_lens)):
        length = start + n
        blocks = -(-length // meta.block_size)
        qs = q[offset:offset + n].transpose(0, 1)[None]  # [1, heads, n, head_dim]
        k = gather_blocks(k_cache, meta.block_tables[i:i + 1, :blocks])[:, :, :length]
        v = gather_blocks(v_cache, meta.block_tables[i:i + 1, :blocks])[:, :, :length]
        pos = torch.arange(start, length, device=q.device)[:, None]
        keys = torch.arange(length, device=q.device)[None, :]
        mask = keys <= pos
        if sliding_window:
            mask &= keys > pos - sliding_window
        o = F.scaled_dot_product_attention(qs, k, v, attn_mask=mask[None, None], scale=scale, enable_gqa=gqa)
        outs.append(o[0].transpose(0, 1))
        offset += n
    return torch.cat(outs)
