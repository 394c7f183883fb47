"""fp8 KV cache scales fitted from a text, through atoll's own ranks (`atoll calibrate-kv`).

calibrate_worker runs on every rank (LLM.run) and builds the rank's ModelRunner as the
engine's worker does. Mode "text": over a float cache (kv_cache_dtype auto: the keys and
values an fp8 cache would quantize, post-rotary, unquantized) it prefills the text's windows,
max_num_seqs at a time, each a sequence from an empty cache, and after each batch reads back
what the cache holds for those tokens: per layer and kv head the largest |k| and |v|, and the
sums of each window's first key and value (position 0: the attention sink). From those
(layers/kv_quant.py's rule): a scale is the largest value over CALIBRATED_RANGE rounded up to a
power of two, a sink the mean of the first positions. Mode "first": the engine's own
--calculate-kv-scales fit instead: an fp8 cache fitting on its first store prefills the text's
first window, and the scales it fitted are read back (what a run whose first prompt is that
window uses; `atoll eval perplexity --calculate-kv-scales`, whose scoring never prefills,
scores with them).

Layouts: TP and PP (every rank returns its stage's layers for the kv heads it holds; the
driver puts them together, models/kv_scales.rank_heads), and CP for mode "first" (the cp ranks
agree on one fit: layers/context_parallel.CpShards.agree); no DP.
"""

from __future__ import annotations

import torch

from atoll.engine.rank.runner import ModelRunner
from atoll.kernels import backend
from atoll.layers.attention import AttentionMetadata
from atoll.layers.context_parallel import CpShards
from atoll.layers.kv_quant import CALIBRATED_RANGE, fit_scale
from atoll.models.kv_scales import rank_heads
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext
from atoll.parallel.pipeline import stage_layers


def calibrate_worker(rank: int, world_size: int, spec, wins: list[list[int]], mode: str = "text", parallel=None,
                     device: str = "cpu", node: str | None = None, ranks_here: int | None = None) -> dict:
    """On every rank: {"layers": this stage's layer ids, "heads": the kv heads it holds, "k":
    [layer][head] scales, "v": the same or None (MLA), "k_sink", "v_sink": [layer][head][channel]
    or None (MLA)}."""
    layout = Layout.parse(spec.layout)
    ctx = ParallelContext.create(layout, rank, device, parallel, node=node) if world_size > 1 \
        else ParallelContext.single(device, parallel)
    with backend.using(spec.engine.kernels):  # the run's kernel path, for this call only
        runner = ModelRunner(spec, ctx, ranks_here=ranks_here)
        batch = runner.spec.engine.max_num_seqs
        if mode == "first":
            _prefill(runner, wins[:1])
            fitted = _fitted(runner.cache)
        else:
            stats = Stats()
            for i in range(0, len(wins), batch):
                _prefill(runner, wins[i:i + batch])
                stats.add(runner.cache, len(wins[i:i + batch]), len(wins[0]))
            fitted = stats.scales()
    start, end = stage_layers(runner.config, layout.pp)[ctx.coords.pp]
    return {"layers": list(range(start, end)), "heads": rank_heads(runner.config, layout.tp, ctx.coords.tp),
            **dict(zip(("k", "v", "k_sink", "v_sink"), fitted))}


@torch.inference_mode()
def _prefill(runner, wins: list[list[int]]) -> None:
    """The windows as one prefill step through this rank's stage, into blocks 0.. of its cache."""
    ctx, bs = runner.ctx, runner.spec.engine.block_size
    n, length = len(wins), len(wins[0])
    per = -(-length // bs)
    tables = [[i * per + j for j in range(per)] for i in range(n)]
    meta = AttentionMetadata.build(tables, [0] * n, [length] * n, bs, device=runner.device)
    tokens = n * length
    x = torch.tensor(wins, dtype=torch.long, device=runner.device).reshape(-1)
    if ctx.layout.cp > 1:  # each cp rank computes its blocks' tokens (layers/context_parallel.py)
        meta = CpShards.build(meta, tables, group=ctx.cp, scratch=runner.num_blocks, device=runner.device)
        x, tokens = x[meta.own], len(meta.own)
    if not ctx.is_first_stage:
        x = ctx.pp.recv((tokens, runner.config.hidden_size), runner.dtype, src=ctx.pp.rank - 1,
                        device=runner.device)
    out = runner.model(x, meta, runner.cache)
    if not ctx.is_last_stage:
        ctx.pp.send(out, dst=ctx.pp.rank + 1)


def _fitted(cache) -> tuple:
    """(k scales, v scales, k sinks, v sinks) an fp8 cache fitted on its first store, per layer."""
    mla = cache.v[0] is None
    k = [x.head_scale.tolist() for x in cache.k]
    if mla:
        return k, None, None, None
    return k, [x.head_scale.tolist() for x in cache.v], [x.sink.tolist() for x in cache.k], \
        [x.sink.tolist() for x in cache.v]


class Stats:
    """Per layer of a float cache: the largest |k| and |v| per kv head, and the sums of the
    windows' first keys and values (float64) and their count."""

    def __init__(self):
        self.firsts = 0
        self.amax: list[list[torch.Tensor | None]] = []  # [layer] = [k amax, v amax]
        self.sums: list[list[torch.Tensor | None]] = []  # [layer] = [k0 sum, v0 sum]

    def add(self, cache, windows: int, length: int) -> None:
        """The first `length` positions of each of the first `windows` sequences (blocks 0.. in order)."""
        per = -(-length // cache.block_size)
        ids = torch.arange(windows * per, device=cache.k[0].device)
        for j, pair in enumerate(zip(cache.k, cache.v)):
            if j == len(self.amax):
                self.amax.append([None, None])
                self.sums.append([None, None])
            for i, c in enumerate(pair):
                if c is None:  # MLA: keys only
                    continue
                x = _tokens(c, ids, windows, length)  # [windows, length, kv_heads, dim]
                top, first = x.abs().amax(dim=(0, 1, 3)), x[:, 0].sum(0, dtype=torch.float64)
                old = self.amax[j][i]
                self.amax[j][i] = top if old is None else torch.maximum(old, top)
                self.sums[j][i] = first if old is None else self.sums[j][i] + first
        self.firsts += windows

    def scales(self) -> tuple:
        """(k scales, v scales, k sinks, v sinks) per layer; MLA's latent (no v): a scale, no sinks."""
        mla = self.amax[0][1] is None
        k = [fit_scale(a[0], CALIBRATED_RANGE).tolist() for a in self.amax]
        if mla:
            return k, None, None, None
        v = [fit_scale(a[1], CALIBRATED_RANGE).tolist() for a in self.amax]
        sinks = [[(s[i] / self.firsts).float().tolist() for s in self.sums] for i in (0, 1)]
        return k, v, sinks[0], sinks[1]


def _tokens(cache: torch.Tensor, ids: torch.Tensor, windows: int, length: int) -> torch.Tensor:
    """[windows, length, kv_heads, dim] float32: the sequences' positions 0..length-1."""
    x = cache.index_select(0, ids)  # [windows * per, block_size, kv_heads, dim]
    return x.view(windows, -1, *x.shape[2:])[:, :length].float()
