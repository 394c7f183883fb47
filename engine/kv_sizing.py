"""How many KV cache blocks a rank gets.

CUDA, the way vLLM users expect: after the weights load, a profiling forward at
max_num_batched_tokens measures the activation peak, and what is left of
gpu_memory_utilization x the GPU's memory becomes KV blocks. CPU: what max_num_seqs
sequences of max_model_len need in every pipeline lane (the LLM bounds max_model_len by its
requests), never a share of free memory. --num-blocks or --kv-cache-gb override both.
Every rank of a job runs the same scheduler, so all take the smallest count (min over ranks).
Counts are per rank: with context parallelism (cp ranks) block j of a sequence lives on cp rank
j % cp, so a sequence takes ceil(blocks / cp) of each rank's blocks and a replica holds cp
times the tokens one rank does.
"""

from __future__ import annotations

import torch

from atoll.errors import InputError
from atoll.layers.attention import AttentionMetadata


def blocks_per_seq(max_model_len: int, block_size: int, cp: int = 1) -> int:
    """Blocks one sequence of max_model_len takes on each rank (its blocks striped over cp ranks)."""
    return -(-(-(-max_model_len // block_size)) // cp)


def cpu_blocks(*, block_size: int, max_num_seqs: int, max_model_len: int, lanes: int, cp: int = 1) -> int:
    return max_num_seqs * blocks_per_seq(max_model_len, block_size, cp) * lanes


def window_blocks(*, width: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int, lanes: int,
                  spec_tokens: int = 0) -> int:
    """Blocks the sliding layers' own cache needs (engine.window_pool) when every sequence lets
    go of the blocks its window has passed: per running sequence its window, the step's new
    positions (1 + spec_tokens) and two blocks of misalignment, plus one step's prompt chunks,
    in every lane."""
    per_seq = -(-(width + 1 + spec_tokens) // block_size) + 2
    return lanes * (max_num_seqs * per_seq + -(-max_num_batched_tokens // block_size))


def full_blocks(blocks: int, window: int, *, full_layers: int, sliding_layers: int) -> int:
    """The full-attention layers' blocks when `blocks` blocks of every layer's memory are split:
    the sliding layers take `window`, the rest of their share goes to the full layers."""
    if not full_layers:
        return 1 << 62  # this stage holds no full-attention layer: another stage sets the count
    return blocks + (blocks - window) * sliding_layers // full_layers


def explicit_blocks(*, bytes_per_block: int, kv_cache_gb: float | None, num_blocks: int | None) -> int | None:
    """--num-blocks, else --kv-cache-gb in blocks, else None."""
    if num_blocks is not None:
        return num_blocks
    if kv_cache_gb is not None:
        return int(kv_cache_gb * (1 << 30)) // bytes_per_block
    return None


def budget_blocks(*, total: int, utilization: float, used_after_load: int, activation_peak: int,
                  bytes_per_block: int) -> int:
    """Blocks that fit in utilization x total once the weights (and whatever else this process
    holds, in used_after_load) and the profiled activation peak above it are counted."""
    free = int(total * utilization) - used_after_load - activation_peak
    if free < bytes_per_block:
        raise InputError(f"no room for a KV cache: --gpu-memory-utilization {utilization} of "
                         f"{total / 2**30:.1f} GiB leaves {max(free, 0) / 2**30:.2f} GiB after the weights "
                         f"({used_after_load / 2**30:.2f} GiB) and the activation peak "
                         f"({activation_peak / 2**30:.2f} GiB); raise it, shard wider or lower "
                         f"--max-num-batched-tokens")
    return free // bytes_per_block


def check_fits(num_blocks: int, *, block_size: int, max_model_len: int, cp: int = 1) -> None:
    """num_blocks: per rank; a sequence's blocks are striped over cp ranks."""
    if num_blocks < blocks_per_seq(max_model_len, block_size, cp):
        ranks = f" ({num_blocks} blocks on each of {cp} cp ranks)" if cp > 1 else ""
        raise InputError(f"the KV cache holds {num_blocks * block_size * cp} tokens per replica{ranks} but one "
                         f"sequence may need max_model_len={max_model_len}: raise --kv-cache-gb or "
                         f"--num-blocks, or lower --max-model-len" + ("" if cp > 1 else ", or shard the "
                         "sequence over context parallel ranks (-cp)"))


def summary(num_blocks: int, *, block_size: int, bytes_per_block: int, max_model_len: int, cp: int = 1,
            window_pool: tuple[int, int] | None = None) -> str:
    """The one line a run prints about its cache (window_pool: the sliding layers' own, engine.window_pool)."""
    tokens = num_blocks * block_size
    seqs = num_blocks // blocks_per_seq(max_model_len, block_size, cp)
    if window_pool is not None:  # bytes_per_block counts every layer: no one size to give
        width, window = window_pool
        return (f"KV cache: {num_blocks} blocks of {block_size} tokens ({tokens} tokens) for the full-attention "
                f"layers, {window} of their own for the sliding-window layers (window {width}); room for {seqs} "
                f"sequences of max_model_len={max_model_len}")
    size = num_blocks * bytes_per_block
    size = f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
    return (f"KV cache: {num_blocks} blocks of {block_size} tokens ({tokens} tokens, {size} per rank); "
            f"room for {seqs} sequences of max_model_len={max_model_len}")


def profile_activation_peak(runner, tokens: int) -> int:
    """Bytes the device allocates above what it holds now while this stage runs a prefill of
    `tokens` tokens (sequences of up to max_model_len) into a throwaway cache. Every rank of the
    job calls it together (its MoE and TP collectives run)."""
    spec, cfg, dev = runner.spec, runner.config, runner.device
    seq_len = min(tokens, spec.max_model_len)
    lens = [seq_len] * (tokens // seq_len) + ([tokens % seq_len] if tokens % seq_len else [])
    per = blocks_per_seq(seq_len, spec.engine.block_size)
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
