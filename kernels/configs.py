"""Launch configurations for Hopper-class GPUs (H100, H200, H800), in one table.

They are picked by shape, not autotuned at run time: autotuning on the first call of every
new token count would stall serving and make runs non-deterministic in time. The MoE entries
are keyed by the expected rows per local expert, m = ceil(tokens * top_k / experts), which is
what sets the grouped GEMM's shape for every model the planner knows (hidden 4096-7168,
experts 8-256, top-k 2-8):

  decode   m <= 16    one BLOCK_M=16 tile per expert; weight reads dominate, so wide K tiles
                      and deep pipelines keep HBM busy (memory bound)
  small    m <= 64    BLOCK_M=32
  medium   m <= 256   BLOCK_M=64, the tensor cores start to matter
  prefill  m >  256   BLOCK_M=128 tiles, 8 warps (compute bound)

Starting points follow the pattern of vLLM's tuned H100/H200 bf16 tables for the same
experts/widths (BLOCK_M 16 until tens of rows per expert, 64-128 for prefill; BLOCK_K 128
when memory bound). `atoll bench kernels --sweep` times the CANDIDATES of the same block_m on
the device and prints the winner per shape, which is how an entry here gets changed. Gemm 1 (gate/up, two accumulators
because of the fused SiLU-and-multiply) keeps BLOCK_N at half of gemm 2's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class GemmConfig:
    block_n: int
    block_k: int
    group_m: int = 1     # block-rows sharing a weight tile before moving along N (L2 reuse)
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoeConfig:
    block_m: int         # rows per tile; moe_align pads every expert to a multiple of it
    gemm1: GemmConfig    # x @ w13^T with SiLU-and-multiply
    gemm2: GemmConfig    # h @ w2^T with the routing weight


# (largest rows per expert, config); the first entry whose bound holds is used
MOE_TABLE: tuple[tuple[float, MoeConfig], ...] = (
    (16, MoeConfig(16, GemmConfig(64, 128, 1, 4, 4), GemmConfig(128, 128, 1, 4, 4))),
    (64, MoeConfig(32, GemmConfig(64, 128, 8, 4, 4), GemmConfig(128, 128, 8, 4, 3))),
    (256, MoeConfig(64, GemmConfig(64, 64, 8, 4, 4), GemmConfig(128, 64, 8, 4, 4))),
    (math.inf, MoeConfig(128, GemmConfig(128, 64, 8, 8, 3), GemmConfig(256, 64, 8, 8, 3))),
)

# alternatives `atoll bench kernels --sweep` times against the table's entry of the same block_m
CANDIDATES: tuple[MoeConfig, ...] = tuple(
    MoeConfig(bm, GemmConfig(bn, bk, g, w, s), GemmConfig(2 * bn, bk, g, w, s))
    for bm in (16, 32, 64, 128)
    for bn, bk, w in ((32, 128, 4), (64, 128, 4), (64, 64, 4), (128, 64, 8))
    for g, s in ((1, 4), (8, 3))
)


def rows_per_expert(tokens: int, top_k: int, experts: int) -> int:
    return -(-tokens * top_k // max(experts, 1))


def moe_config(tokens: int, top_k: int, experts: int) -> MoeConfig:
    m = rows_per_expert(tokens, top_k, experts)
    return next(cfg for bound, cfg in MOE_TABLE if m <= bound)


def gemm_config(block_m: int, *, silu_mul: bool = False) -> GemmConfig:
    """Tiles for a caller of grouped_gemm that brings its own alignment: the table entry with
    that block_m (gemm 1's tiles when silu_mul, else gemm 2's)."""
    cfg = next((c for _, c in MOE_TABLE if c.block_m == block_m), MOE_TABLE[0][1])
    return cfg.gemm1 if silu_mul else cfg.gemm2


# row kernels: one program per row (rms_norm) or per token (rotary, unpermute_reduce)
def norm_warps(hidden: int) -> int:
    return 4 if hidden <= 2048 else 8 if hidden <= 8192 else 16


ALIGN_BLOCK = 128       # pairs per program in moe_align (its rank step compares BLOCK x BLOCK)
UNPERMUTE_BLOCK_N = 1024
ROTARY_BLOCK_H = 4      # heads per program


def dot_precision(dtype: torch.dtype) -> str:
    """float32 inputs are multiplied in full precision ("ieee"), not TF32, so the float32
    path matches the reference to float32 tolerance; bf16/fp16 use the tensor cores as is."""
    return "ieee" if dtype == torch.float32 else "tf32"
