"""Context parallelism (cp): every sequence's KV cache striped over the cp ranks, attention
computed as partials over each rank's keys and merged exactly by their log-sum-exp.

Block j of a sequence's block table lives on cp rank j % cp (engine.kv.blocks: the pool hands out
global ids local * cp + rank, read here as local block id // cp), so each rank keeps about
1/cp of every sequence's cache and a sequence may outgrow one rank's blocks.

A step runs one of two ways (every rank knows which from the same schedule):

- decode (every sequence brings one token): every cp rank computes every token (at long
  context the cache, not the weights, is what a decode step reads); only the rank owning a
  token's block writes its K/V (the others write it into the scratch block). Each rank
  attends over its own blocks, giving a partial output and the log-sum-exp of its scores,
  and one all-gather of [seqs, heads, head_dim + 1] over the cp group lets every rank merge
  them: one small collective per layer.
- prefill (or a step mixing prefill chunks with decodes): rank r computes the tokens whose
  block lives on it, so a long prompt's early and late blocks alternate between the ranks and
  the causal work balances (a zigzag split at block granularity), and each rank writes only
  its own blocks. Attention all-gathers the step's queries over the cp group, attends every
  query over this rank's blocks (earlier chunks and prefix-cache hits included, so chunked
  prefill and prefix caching work unchanged), and one all-to-all hands each rank the
  partials of its own tokens from every rank, merged by log-sum-exp. The last stage
  all-gathers the hidden rows, so the lm head and the sampler see the step as without cp.
  Queries rather than keys travel: a rank's keys include its cached blocks, which a K/V
  all-gather or a ring would have to send every step, while the step's queries are known.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atoll.layers.attention import AttentionMetadata, gather_blocks

_CHUNK = 512  # queries scored at a time: bounds the [heads, queries, keys] score matrix
FUSED = True  # on the CPU, torch's fused flash kernel (False: the plain float32 path other devices take)


@dataclass
class CpShards:
    """One step as cp rank `group.rank` sees it; the model reads it as its metadata.
    Token indices are into the step's flat batch (AttentionMetadata's order)."""

    group: object  # comm.group.Group over the cp ranks
    full: AttentionMetadata  # the whole step (global block ids): last_tokens, is_decode
    own: torch.Tensor  # [own tokens] the flat tokens this rank computes (decode: all of them)
    positions: torch.Tensor  # [own tokens] their positions
    slots: tuple[torch.Tensor, torch.Tensor]  # (local block, offset) each own token's K/V goes to
    counts: list[int]  # tokens each cp rank computes (prefill)
    unpad: torch.Tensor | None  # [tokens] each flat token's row among the gathered [cp * max(counts)]
    by_rank: torch.Tensor | None  # [tokens] the flat tokens ordered by the rank computing them
    tables: list[torch.Tensor]  # per sequence: this rank's blocks of it (local ids) up to its length
    key_pos: list[torch.Tensor]  # per sequence: the position of every key in those blocks
    query_pos: torch.Tensor  # [tokens] every token's position
    decode: bool

    @classmethod
    def build(cls, full: AttentionMetadata, block_tables: list[list[int]], *, group, scratch: int,
              device="cpu") -> "CpShards":
        """full: the step's metadata; block_tables: each sequence's global block ids; scratch:
        this rank's scratch block (the pool's hole reads as it too)."""
        cp, me, bs = group.size, group.rank, full.block_size
        decode = full.is_decode
        own, pos, block, offset = [], [], [], []
        by_rank: list[list[int]] = [[] for _ in range(cp)]
        tables, key_pos = [], []
        t = 0
        for table, start, n in zip(block_tables, full.start_list, full.query_lens):
            for p in range(start, start + n):
                owner = (p // bs) % cp
                by_rank[owner].append(t)
                if decode or owner == me:
                    own.append(t)
                    pos.append(p)
                    block.append(table[p // bs] // cp if owner == me else scratch)
                    offset.append(p % bs if owner == me else 0)
                t += 1
            mine = range(me, -(-(start + n) // bs), cp)
            tables.append([table[j] // cp for j in mine])
            key_pos.append([j * bs + o for j in mine for o in range(bs)])
        counts = [len(r) for r in by_rank]
        width = max(counts)
        unpad = [0] * t
        for r, rows in enumerate(by_rank):
            for i, row in enumerate(rows):
                unpad[row] = r * width + i

        def tensor(x):
            return torch.tensor(x, dtype=torch.long, device=device)

        if decode:  # one padded batch: pad blocks are the scratch block at positions past every query
            nb = max(1, max(len(b) for b in tables))
            far = 1 << 62
            tables = [tensor([b + [scratch] * (nb - len(b)) for b in tables])]
            key_pos = [tensor([k + [far] * (nb * bs - len(k)) for k in key_pos])]
        else:
            tables, key_pos = [tensor(b) for b in tables], [tensor(k) for k in key_pos]
        return cls(group, full, tensor(own), tensor(pos), (tensor(block), tensor(offset)), counts,
                   None if decode else tensor(unpad), None if decode else tensor(sum(by_rank, [])),
                   tables, key_pos, full.positions, decode)

    # what the model reads of its metadata
    @property
    def is_decode(self) -> bool:
        return self.decode

    @property
    def device(self) -> torch.device:
        return self.positions.device

    def token_blocks(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.slots

    def last_tokens(self) -> torch.Tensor:
        return self.full.last_tokens()

    def agree(self, x: torch.Tensor, op: str) -> torch.Tensor:
        """x summed (op "sum") or maxed over the cp group: a quantized cache fitting its scales on
        the first prefill (layers/kv_quant.py) sees every cp rank's share of the tokens."""
        return self.group.all_reduce(x, op=op)

    def attend(self, q: torch.Tensor, k_cache, v_cache, *, sliding_window: int | None = None,
               scale: float | None = None) -> torch.Tensor:
        """q: [own tokens, heads, head_dim] (already written to the cache) -> [own tokens, heads, head_dim]."""
        g, cp = self.group, self.group.size
        heads, dv = q.shape[1], v_cache.shape[-1]
        if self.decode:
            first = g.rank == 0  # block 0 (position 0, an fp8 sink's) lives on cp rank 0
            k = gather_blocks(k_cache, self.tables[0], first=first)  # [seqs, kv_heads, keys, head_dim]
            v = gather_blocks(v_cache, self.tables[0], first=first)
            mask = visible(self.query_pos[:, None], self.key_pos[0], sliding_window)  # [seqs, keys]
            out, lse = partial_attention(q[:, :, None], k, v, mask[:, None, None], scale)
            parts = g.all_gather(pack(out[:, :, 0], lse[:, :, 0])[None], dim=0)  # [cp, seqs, heads, dv + 1]
            return merge(parts).to(q.dtype)
        width = max(self.counts)
        padded = q.new_zeros(width, heads, q.shape[2])
        padded[:len(q)] = q
        q_all = g.all_gather(padded[None], dim=0).view(cp * width, heads, q.shape[2])[self.unpad]
        bs, outs, start = self.full.block_size, [], 0
        for i, (first, n) in enumerate(zip(self.full.start_list, self.full.query_lens)):
            k = gather_blocks(k_cache, self.tables[i][None], first=g.rank == 0)  # [1, kv_heads, keys here, head_dim]
            v = gather_blocks(v_cache, self.tables[i][None], first=g.rank == 0)
            for a in range(0, n, _CHUNK):  # a chunk of queries reads only the keys up to its last position
                b = min(n, a + _CHUNK)
                keys = len(range(g.rank, (first + b - 1) // bs + 1, cp)) * bs  # this rank's keys before it
                qs = q_all[start + a:start + b].transpose(0, 1)[None]  # [1, heads, b - a, head_dim]
                if keys == 0:  # none of them lives here: a part that weighs nothing
                    none = q.new_zeros(b - a, heads, dv + 1, dtype=torch.float32)
                    none[..., dv] = float("-inf")
                    outs.append(none)
                    continue
                qpos = self.query_pos[start + a:start + b]
                mask = visible(qpos[:, None], self.key_pos[i][None, :keys], sliding_window)  # [b - a, keys]
                out, lse = partial_attention(qs, k[:, :, :keys], v[:, :, :keys], mask[None, None], scale)
                outs.append(pack(out[0].transpose(0, 1), lse[0].transpose(0, 1)))  # [b - a, heads, dv + 1]
            start += n
        rows = torch.cat(outs)[self.by_rank]
        mine = self.counts[g.rank]
        got = g.all_to_all(rows, self.counts, [mine] * cp)  # every rank's partials of my tokens
        return merge(got.view(cp, mine, heads, dv + 1)).to(q.dtype)

    def gather_rows(self, h: torch.Tensor) -> torch.Tensor:
        """[own tokens, hidden] of a prefill step -> [tokens, hidden] of the whole step, in order."""
        if self.decode:
            return h
        width = max(self.counts)
        padded = h.new_zeros(width, *h.shape[1:])
        padded[:len(h)] = h
        return self.group.all_gather(padded[None], dim=0).view(self.group.size * width, *h.shape[1:])[self.unpad]


def visible(qpos: torch.Tensor, kpos: torch.Tensor, sliding_window: int | None) -> torch.Tensor:
    """Which keys (at positions kpos) each query (at qpos) attends to: causal, within the window."""
    mask = kpos <= qpos
    if sliding_window:
        mask &= kpos > qpos - sliding_window
    return mask


def partial_attention(q, k, v, mask, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """q: [b, heads, n, d], k, v: [b, kv_heads, keys, d], mask: [b, 1, n, keys] ->
    (out [b, heads, n, dv] float32, lse [b, heads, n] float32): attention over these keys only,
    and the log-sum-exp of its scaled scores (-inf and a zero output where no key is visible).
    On the CPU torch's fused flash kernel (it returns the lse); elsewhere scores in float32,
    _CHUNK queries at a time."""
    heads, kv_heads = q.shape[1], k.shape[1]
    if heads != kv_heads:
        k = k.repeat_interleave(heads // kv_heads, dim=1)
        v = v.repeat_interleave(heads // kv_heads, dim=1)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    flash = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if FUSED and q.device.type == "cpu" and flash is not None:  # torch's fused CPU kernel, which returns the lse too
        bias = torch.zeros(mask.shape, dtype=q.dtype, device=q.device).masked_fill(~mask, float("-inf"))
        out, lse = flash(q, k.to(q.dtype), v.to(q.dtype), 0.0, False, attn_mask=bias, scale=scale)
        empty = ~mask.any(dim=-1)  # [b, 1, n]: it gives such a row lse 0, which must weigh nothing
        return out.float().masked_fill(empty[..., None], 0.0), lse.float().masked_fill(empty, float("-inf"))
    k, v = k.float(), v.float()
    outs, lses = [], []
    for a in range(0, q.shape[2], _CHUNK):
        s = torch.matmul(q[:, :, a:a + _CHUNK].float(), k.transpose(-1, -2)) * scale
        s = s.masked_fill(~mask[:, :, a:a + _CHUNK], float("-inf"))
        lse = torch.logsumexp(s, dim=-1)
        p = torch.exp(s - torch.where(torch.isinf(lse), 0.0, lse)[..., None])  # all masked: exp(-inf) = 0
        outs.append(torch.matmul(p, v))
        lses.append(lse)
    return torch.cat(outs, dim=2), torch.cat(lses, dim=2)


def pack(out: torch.Tensor, lse: torch.Tensor) -> torch.Tensor:
    """[..., dv] and [...] -> [..., dv + 1] float32: one tensor for one collective."""
    return torch.cat([out.float(), lse.float()[..., None]], dim=-1)


def merge(parts: torch.Tensor) -> torch.Tensor:
    """parts: [cp, ..., dv + 1] packed partials -> [..., dv]: each rank's output weighted by
    exp(its lse - the total lse). Every query sees at least itself, so some lse is finite."""
    out, lse = parts[..., :-1], parts[..., -1]
    top = lse.max(dim=0).values
    w = torch.exp(lse - top)  # [cp, ...]; a rank with no visible key weighs 0
    return (w[..., None] * out).sum(0) / w.sum(0)[..., None]
