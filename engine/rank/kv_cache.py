"""A rank's KV cache: how many blocks it gets (every rank the same count), the activation peak
profiled on CUDA before the cache takes the rest, the paged cache itself and its fp8 scales."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

from atoll.engine.kv import sizing as kv
from atoll.layers.attention import AttentionMetadata, KVCache
from atoll.layers.kv_quant import kv_format
from atoll.models import kv_scales
from atoll.parallel.pipeline import stage_layers


def make_cache(config, tp: int, *, layers: int, blocks: int | list[int], block_size: int, dtype, device,
               kv_cache_dtype: str = "auto", scales: list | None = None, fit_first: bool = False):
    """The paged cache of `layers` layers on one rank (layers.attention.KVCache; keys only for MLA),
    quantized when kv_cache_dtype is not auto; blocks: every layer's count, or each layer's.
    scales, fit_first: fp8 e4m3's fixed scales for these layers and heads (scales_for), or a fit
    on the first store; neither: scale 1, sink 0."""
    s = kv.token_shape(config, tp)
    return KVCache(layers, blocks, s.heads, block_size, s.dim, dtype, device=device, values=s.values,
                   kv_format=kv_format(kv_cache_dtype), scales=scales, fit_first=fit_first)


def scales_for(runner) -> tuple[list | None, bool, str]:
    """(this rank's fixed fp8 scales, one tuple a layer of its stage, or None; whether to fit them
    on the first prefill; a line saying which), from the sources models/kv_scales.py lists."""
    eng, config, ctx = runner.spec.engine, runner.config, runner.ctx
    fmt = kv_format(eng.kv_cache_dtype)
    if fmt is None or not fmt.static:
        return None, False, ""
    if eng.calculate_kv_scales:
        return None, True, "fitted on the first prefill (--calculate-kv-scales: they depend on that prompt)"
    found = kv_scales.read_file(eng.kv_scales, config) if eng.kv_scales else \
        kv_scales.from_checkpoint(runner.checkpoint, config)
    beside = Path(runner.spec.model_dir) / kv_scales.FILE_NAME
    if found is None and beside.is_file():
        found = kv_scales.read_file(beside, config)
    if found is None:
        return None, False, ("1 and no sink (vLLM's default): none in the checkpoint or beside it; "
                             "atoll calibrate-kv or --calculate-kv-scales fits them")
    start, end = stage_layers(config, ctx.layout.pp)[ctx.coords.pp]
    heads = kv_scales.rank_heads(config, ctx.layout.tp, ctx.coords.tp)
    return found.for_rank(range(start, end), heads), False, f"from {found.source}"


def hybrid_width(runner) -> int | None:
    """The sliding layers' widest window when they keep their own cache (engine.kv.windowed):
    a model with both kinds of layer, unless switched off or in a job whose other parts read one
    table per sequence (context parallel stripes, a disaggregated transfer, a draft model's cache)."""
    eng, width = runner.spec.engine, runner.config.hybrid_window
    draft = eng.speculative_config is not None and eng.speculative_config.model is not None
    if width is None or eng.disable_hybrid_kv_cache_manager or runner.ctx.layout.cp > 1 \
            or eng.prefill is not None or draft:
        return None
    return width


def size_cache(runner) -> int:
    """Blocks per rank, the same on every rank (engine.kv.sizing); sets runner.window_pool
    when the sliding layers keep their own cache."""
    spec, cp = runner.spec, runner.ctx.layout.cp
    blocks = kv.explicit_blocks(bytes_per_block=runner.bytes_per_block, kv_cache_gb=spec.engine.kv_cache_gb,
                                num_blocks=spec.engine.num_blocks)
    if blocks is None and runner.device.type == "cuda":
        peak = profile_activation_peak(runner, spec.max_num_batched_tokens)
        free, total = torch.cuda.mem_get_info(runner.device)
        blocks = kv.budget_blocks(total=total, utilization=spec.engine.gpu_memory_utilization,
                                  used_after_load=total - free, activation_peak=peak,
                                  bytes_per_block=runner.bytes_per_block)
    elif blocks is None:
        blocks = kv.cpu_blocks(block_size=spec.engine.block_size, max_num_seqs=spec.cache_seqs or spec.engine.max_num_seqs,
                               max_model_len=spec.max_model_len, lanes=runner.ctx.layout.pp, cp=cp)
    width, window, full = hybrid_width(runner), None, blocks
    if width is not None:
        k = spec.engine.speculative_config.k if spec.engine.speculative_config else 0
        window = kv.window_blocks(width=width, block_size=spec.engine.block_size,
                                  max_num_seqs=spec.engine.max_num_seqs,
                                  max_num_batched_tokens=spec.max_num_batched_tokens, lanes=runner.ctx.layout.pp,
                                  spec_tokens=k)
        kinds = runner.local_windows()
        full = kv.full_blocks(blocks, min(window, blocks), sliding_layers=sum(w is not None for w in kinds),
                              full_layers=sum(w is None for w in kinds))
    if runner.ctx.layout.world_size > 1:  # every rank schedules the same blocks
        t = torch.tensor([blocks, full], dtype=torch.long, device=runner.device)
        blocks, full = runner.ctx.world.all_reduce(t, op="min").tolist()
    if window is not None and window < blocks:  # else the sliding layers would save nothing
        runner.window_pool, blocks = (width, window), full
    kv.check_fits(blocks, block_size=spec.engine.block_size, max_model_len=spec.max_model_len, cp=cp)
    if runner.ctx.rank == 0:
        print("atoll: " + kv.summary(blocks, block_size=spec.engine.block_size, bytes_per_block=runner.bytes_per_block,
                                     max_model_len=spec.max_model_len, cp=cp, window_pool=runner.window_pool),
              file=sys.stderr, flush=True)
    return blocks


def profile_activation_peak(runner, tokens: int) -> int:
    """Bytes the device allocates above what it holds now while this stage runs a prefill of
    `tokens` tokens (sequences of up to max_model_len) into a throwaway cache. Every rank of the
    job calls it together (its MoE and TP collectives run)."""
    spec, cfg, dev = runner.spec, runner.config, runner.device
    seq_len = min(tokens, spec.max_model_len)
    lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    per = kv.blocks_per_seq(seq_len, spec.engine.block_size)
    scratch = runner.new_cache(per * len(lens))
    tables = [list(range(i * per, (i + 1) * per)) for i in range(len(lens))]
    meta = AttentionMetadata.build(tables, [0] * len(lens), lens, spec.engine.block_size, device=dev)
    torch.cuda.synchronize(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    if runner.ctx.is_first_stage:
        x = torch.zeros(tokens, dtype=torch.long, device=dev)
    else:
        x = torch.zeros(tokens, cfg.hidden_size, dtype=runner.dtype, device=dev)
    with torch.inference_mode():
        runner.model(x, meta, scratch)
    torch.cuda.synchronize(dev)
    peak = torch.cuda.max_memory_allocated(dev) - before
    del scratch, x
    torch.cuda.empty_cache()
    return peak
