"""How big the KV cache is: what one token holds in one layer on one rank, the bytes of a block,
and how many blocks a rank gets. The runtime (the driver's checks, every rank's sizing) and the
planner's memory model call these functions, so each figure is computed once, without torch.

GQA: k and v, kv heads split over tp, at least one per rank (tp > kv_heads replicates them).
MLA: one latent vector of kv_lora_rank + qk_rope_head_dim, no head axis to split and no
separate v; every TP rank holds it whole (576 values a token for DeepSeek-V3). A quantized
cache (--kv-cache-dtype, layers/kv_quant.py) stores each value in its format's bytes plus, for
int8, a float32 scale per token and head (config.engine.KV_STORAGE); fp8 e4m3's fixed scales are
a few bytes per layer whatever the cache's size (static_scale_bytes), which the planner adds.

How many blocks:

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

from dataclasses import dataclass

import psutil

from atoll.config.engine import KV_STORAGE
from atoll.errors import InputError
from atoll.parallel.pipeline import stage_layers


@dataclass(frozen=True)
class TokenShape:
    """One token in one layer on one rank: `heads` x `dim`, and a v of that shape too if `values`."""

    heads: int
    dim: int
    values: bool

    def bytes(self, itemsize: float, scale_bytes: float = 0) -> float:
        """itemsize per value, plus scale_bytes per head (a quantized cache's scale)."""
        return (2 if self.values else 1) * self.heads * (self.dim * itemsize + scale_bytes)


def gqa_shape(*, kv_heads: int, head_dim: int, tp: int) -> TokenShape:
    return TokenShape(heads=max(kv_heads // tp, 1), dim=head_dim, values=True)


def mla_shape(*, kv_latent: int) -> TokenShape:
    return TokenShape(heads=1, dim=kv_latent, values=False)


def token_shape(config, tp: int) -> TokenShape:
    """The shape for a ModelConfig's attention kind."""
    if config.is_mla:
        return mla_shape(kv_latent=config.kv_lora_rank + config.qk_rope_head_dim)
    return gqa_shape(kv_heads=config.num_key_value_heads, head_dim=config.head_dim, tp=tp)


def kv_bytes_per_token_layer(*, kv_heads: int, head_dim: int, tp: int, itemsize: float,
                             kv_latent: int = 0, scale_bytes: float = 0) -> float:
    """One token in one layer on one TP rank (the planner's Shapes call this): MLA when kv_latent > 0.
    scale_bytes: a quantized cache's scale bytes per token and head (storage_bytes)."""
    shape = mla_shape(kv_latent=kv_latent) if kv_latent else gqa_shape(kv_heads=kv_heads, head_dim=head_dim, tp=tp)
    return shape.bytes(itemsize, scale_bytes)


def storage_bytes(itemsize: float, kv_cache_dtype: str | None = "auto") -> tuple[float, float]:
    """(bytes per value, scale bytes per token and head) of a cache in `kv_cache_dtype`
    (auto: the compute dtype's itemsize, no scale)."""
    return (itemsize, 0) if kv_cache_dtype in (None, "auto") else KV_STORAGE[kv_cache_dtype]


def static_scale_bytes(config, tp: int, layers: int, kv_cache_dtype: str | None = "auto") -> int:
    """Bytes of fp8 e4m3's fixed scales on one rank holding `layers` layers (layers/kv_quant.py):
    a float32 scale per kv head and a float32 sink per kv head and channel, for k and for v
    (MLA's latent: one scale a layer). Whatever the cache's size: SmolLM2-135M's 30 layers of 3
    kv heads of 64 hold 30 x 3 x 2 x (4 + 256) = 46,800 bytes, DeepSeek-V3's 61 latent layers 244."""
    if kv_cache_dtype not in ("fp8", "fp8_e4m3"):
        return 0
    s = token_shape(config, tp)
    per_head = 4 * 2 * (1 + s.dim) if s.values else 4  # k and v: a scale and a sink each; MLA: one scale
    return layers * s.heads * per_head


def kv_bytes_per_block(config, layout, itemsize: int, block_size: int, *, kv_cache_dtype: str = "auto") -> int:
    """One block of the largest pipeline stage's cache on one rank, in the compute dtype's
    itemsize or the quantized storage of kv_cache_dtype (values + scales)."""
    layers = max(end - start for start, end in stage_layers(config, layout.pp))
    return int(block_size * layers * token_shape(config, layout.tp).bytes(*storage_bytes(itemsize, kv_cache_dtype)))


def available_memory() -> int:
    """Bytes this machine can still give (psutil's available memory)."""
    return psutil.virtual_memory().available


def blocks_per_seq(max_model_len: int, block_size: int, cp: int = 1) -> int:
    """Blocks one sequence of max_model_len takes on each rank (its blocks striped over cp ranks)."""
    return -(-(-(-max_model_len // block_size)) // cp)


def cpu_blocks(*, block_size: int, max_num_seqs: int, max_model_len: int, lanes: int, cp: int = 1) -> int:
    return max_num_seqs * blocks_per_seq(max_model_len, block_size, cp) * lanes


def window_blocks(*, width: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int, lanes: int,
                  spec_tokens: int = 0) -> int:
    """Blocks the sliding layers' own cache needs (engine.kv.windowed) when every sequence lets
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
    """The one line a run prints about its cache (window_pool: the sliding layers' own, engine.kv.windowed)."""
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
