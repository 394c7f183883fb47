"""Moving one prompt's KV cache from the prefill engine to the decode engine, between layouts.

Scheme. A rank of either engine holds, for the layers of its pipeline stage, the KV heads of
its TP rank (layers.linear: a 1/tp share, or one head replicated on tp/kv_heads ranks). On
the prefill side each KV head has one owner: the lowest TP rank holding it in replica 0 (the
prefill engine runs one replica). For every pair (prefill rank p, decode rank q of the
replica that serves the request) one message carries the layers both stages hold and the
heads p owns that q holds: [layers, 2 (k, v), prompt tokens, heads, head_dim], each k and v
read from p's paged cache at the sequence's blocks and written into q's at its own blocks
(block sizes may differ). Every head of every layer is sent once to each decode rank that
holds it, so the bytes for a prompt of T tokens are

    layers x T x 2 x kv_heads x head_dim x dtype bytes x r,

r = max(1, decode tp / kv_heads), the decode side's own replication of heads (1 when its tp
divides kv_heads): `analytic_bytes`.

A quantized cache (--kv-cache-dtype fp8/int8, layers/kv_quant.py; both engines share the
run's one setting) is sent as it is stored: each message carries the 8-bit values and, for
int8, their float32 scales (one per token, head and k/v), and the decode side writes both
into its cache unchanged, so it reads exactly the bytes the prefill engine's cache holds.
fp8 e4m3's fixed scales and sinks (a few bytes per layer and head) are not sent: every
rank of both engines reads them at load from the one source the run names (--kv-scales, the
checkpoint's k_scale/v_scale, or atoll-kv-scales.json beside it: models/kv_scales.py), so the
decode engine reads the bytes under the scales they were written with. --calculate-kv-scales,
where each engine would fit its own on its own first prefill, is refused with --prefill/
--decode (config/engine.py).
A message is one buffer of bytes: the values [layers, 2, T, heads, head_dim] then the scales
[layers, 2, T, heads]; per token and head, dtype bytes becomes head_dim x 1 byte + 4 (int8)
or head_dim x 1 byte (fp8) in the figure above. MLA's latent cache is one "head" of kv_lora_rank +
qk_rope_head_dim values and no v (576 a token for DeepSeek-V3), which every TP rank holds
whole: the prefill engine's TP rank 0 of each stage sends it to every decode rank holding the
layer, layers x T x 576 x dtype bytes x decode tp. Messages go in one order, (decode rank, prefill rank),
on every process, with blocking send/recv: the first unfinished message always has both
ends waiting on it, so the exchange cannot deadlock.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from atoll.layers.kv_quant import QuantizedKV
from atoll.parallel.layout import Layout
from atoll.parallel.pipeline import stage_layers


def cache_heads(config) -> tuple[int, int, bool]:
    """(heads, values per head, whether v is separate) of a token's cache in one layer, all
    TP ranks together: GQA's kv heads x head_dim with v, or MLA's one latent vector."""
    if getattr(config, "is_mla", False):
        return 1, config.kv_lora_rank + config.qk_rope_head_dim, False
    return config.num_key_value_heads, config.head_dim, True


def heads_held(kv_heads: int, tp: int, rank: int) -> list[int]:
    """The KV heads TP rank `rank` of `tp` holds (layers.linear.QKVParallelLinear's split)."""
    if kv_heads >= tp:
        share = kv_heads // tp
        return list(range(rank * share, (rank + 1) * share))
    return [rank // (tp // kv_heads)]


def heads_owned(kv_heads: int, tp: int, rank: int) -> list[int]:
    """The heads this rank sends: those no lower TP rank holds."""
    lower = {h for r in range(rank) for h in heads_held(kv_heads, tp, r)}
    return [h for h in heads_held(kv_heads, tp, rank) if h not in lower]


@dataclass(frozen=True)
class Message:
    src: int  # prefill engine rank
    dst: int  # decode engine rank
    layers: tuple[int, ...]  # model layer ids
    heads: tuple[int, ...]  # KV head ids


def plan(config, src: Layout, dst: Layout, replica: int = 0) -> list[Message]:
    """Every message for one prompt, to decode replica `replica`, in the order all ranks use."""
    kv = cache_heads(config)[0]
    src_stages, dst_stages = stage_layers(config, src.pp), stage_layers(config, dst.pp)
    out = []
    for qs, (q_start, q_end) in enumerate(dst_stages):
        for qt in range(dst.tp):
            q = qs * dst.stage_size + replica * dst.tp + qt
            want = set(heads_held(kv, dst.tp, qt))
            for ps, (p_start, p_end) in enumerate(src_stages):
                for pt in range(src.tp):
                    layers = tuple(range(max(p_start, q_start), min(p_end, q_end)))
                    heads = tuple(h for h in heads_owned(kv, src.tp, pt) if h in want)
                    if layers and heads:
                        out.append(Message(ps * src.stage_size + pt, q, layers, heads))
    return sorted(out, key=lambda m: (m.dst, m.src))


def analytic_bytes(config, dst: Layout, tokens: int, itemsize: int, scale_bytes: int = 0) -> int:
    """The bytes one prompt's KV takes to send (see the module docstring): itemsize, the
    cache's bytes per value; scale_bytes, its scale's bytes per token and head (int8: 4)."""
    kv, dim, values = cache_heads(config)
    per_head = dim * itemsize + scale_bytes
    return config.num_hidden_layers * tokens * (2 if values else 1) * kv * per_head * max(1, dst.tp // kv)


def _positions(blocks: list[int], tokens: int, block_size: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset) of positions 0 .. tokens - 1 of a sequence with this block table."""
    pos = torch.arange(tokens, device=device)
    block = torch.tensor(blocks, dtype=torch.long, device=device)[pos // block_size]
    return block, pos % block_size


def _planes(layer) -> list[torch.Tensor]:
    """The tensors one layer's k (or v) cache stores, each [blocks, block_size, heads, ...]:
    a plain tensor, or a quantized cache's values and scales; 1-byte dtypes as uint8 (the
    same storage: fp8 is read and written as its bytes)."""
    planes = layer.tensors() if isinstance(layer, QuantizedKV) else [layer]
    return [t.view(torch.uint8) if t.element_size() == 1 else t for t in planes]


def _shapes(runner, layers: int, tokens: int, heads: int) -> list[tuple[tuple[int, ...], torch.dtype]]:
    """(shape, dtype) of each plane a message carries, from this rank's own cache layer 0."""
    kinds = len(_kinds(runner.cache))
    return [((layers, kinds, tokens, heads, *t.shape[3:]), t.dtype) for t in _planes(runner.cache.k[0])]


def send(runner, messages: list[Message], rank: int, blocks: list[int], tokens: int, world, dst_base: int) -> int:
    """Send this prefill rank's messages for one sequence; returns the bytes sent. `world`:
    the job's Group (ranks are job ranks); decode rank q is job rank dst_base + q."""
    cfg, ctx = runner.config, runner.ctx
    first = runner.model.model.start
    mine = set(heads_held(cache_heads(cfg)[0], ctx.layout.tp, ctx.coords.tp))
    local = {h: i for i, h in enumerate(sorted(mine))}
    block, offset = _positions(blocks, tokens, runner.spec.engine.block_size, runner.device)
    sent = 0
    for m in messages:
        if m.src != rank:
            continue
        at = torch.tensor([local[h] for h in m.heads], device=runner.device)
        planes = []
        for p in range(len(_planes(runner.cache.k[0]))):
            parts = [torch.stack([_planes(c[layer - first])[p][block, offset][:, at] for c in _kinds(runner.cache)])
                     for layer in m.layers]
            planes.append(torch.stack(parts).contiguous())  # [layers, 2, tokens, heads(, head_dim)]
        x = torch.cat([t.view(torch.uint8).reshape(-1) for t in planes])  # the planes' bytes, in order
        world.send(x, dst=world.ranks.index(dst_base + m.dst))
        sent += x.numel()
    return sent


def receive(runner, messages: list[Message], rank: int, blocks: list[int], tokens: int, world,
            src_base: int) -> int:
    """Receive this decode rank's messages for one sequence into its cache at `blocks`;
    returns the bytes received."""
    cfg, ctx = runner.config, runner.ctx
    first = runner.model.model.start
    kv = cache_heads(cfg)[0]
    mine = sorted(heads_held(kv, ctx.layout.tp, ctx.coords.tp))
    local = {h: i for i, h in enumerate(mine)}
    block, offset = _positions(blocks, tokens, runner.spec.engine.block_size, runner.device)
    got = 0
    for m in messages:
        if m.dst != rank:
            continue
        shapes = _shapes(runner, len(m.layers), tokens, len(m.heads))
        sizes = [math.prod(shape) * dtype.itemsize for shape, dtype in shapes]
        x = world.recv((sum(sizes),), torch.uint8, src=world.ranks.index(src_base + m.src), device=runner.device)
        at = torch.tensor([local[h] for h in m.heads], device=runner.device)
        for p, (chunk, (shape, dtype)) in enumerate(zip(x.split(sizes), shapes)):
            if chunk.storage_offset() % dtype.itemsize:  # a view to a wider dtype needs aligned bytes
                chunk = chunk.clone()
            got_plane = chunk.view(dtype).view(shape)
            for i, layer in enumerate(m.layers):
                for j, c in enumerate(_kinds(runner.cache)):
                    view = _planes(c[layer - first])[p]  # [blocks, block_size, heads(, head_dim)]
                    rows = view[block, offset]
                    rows[:, at] = got_plane[i, j]
                    view[block, offset] = rows
        got += x.numel()
    return got


def _kinds(cache) -> tuple:
    """The cache's per-layer lists a message carries: k and v, or MLA's latent k alone."""
    return (cache.k,) if cache.v[0] is None else (cache.k, cache.v)
