"""Every efficiency factor and fixed cost of the cost model, in one place, with its source.

A factor multiplies a peak from the topology (data-sheet TFLOPS, HBM or link bandwidth) to
give what kernels reach. None is fitted to the predictions the tests check; each comes from
a measurement or a published figure named beside it.
"""

from atoll.config.engine import LARGE_DEVICE_GIB, default_batched_tokens

# Dense GEMM: 8192^3 bf16 matmul measured at ~790 of 989 TFLOP/s on one H200 (REFERENCE.md,
# measured on this project's machine): 0.80. Used for prefill and any compute-bound GEMM.
GEMM_EFFICIENCY = 0.80
# fp8 GEMMs with DeepSeek-V3's fine-grained (block) scaling: DeepGEMM, the kernels SGLang, vLLM
# and DeepSeek run them with, reports "1350+ FP8 TFLOPS" on Hopper (deepseek-ai/DeepGEMM README,
# its release note) of the 1,979 dense fp8 peak: 0.68.
FP8_GEMM_EFFICIENCY = 0.68


def gemm_efficiency(dtype: str) -> float:
    """The share of the data-sheet peak a large GEMM of the weights' dtype reaches."""
    return FP8_GEMM_EFFICIENCY if dtype == "fp8" else GEMM_EFFICIENCY

# Attention core in prefill (FlashAttention-style): FlashAttention-3 reports ~600-750 of 989
# TFLOP/s bf16 on H100 for long sequences; 0.60 is the lower end, as prompts here are ~1k tokens.
ATTENTION_EFFICIENCY = 0.60

# HBM streaming: device-to-device copy measured at ~4.3 of 4.8 TB/s on one H200 (REFERENCE.md):
# 0.90. Decode GEMMs and attention over the KV cache are reads of this kind.
HBM_EFFICIENCY = 0.90

# Weights streamed through a GEMM at decode sizes (a few to a few hundred rows): a tuned Hopper
# GEMM reads them at well under copy speed. DeepGEMM's README (deepseek-ai/DeepGEMM) measured its
# fp8 GEMMs at M = 64 and 128 over DeepSeek-V3's shapes at 1,509-2,668 GB/s on an H800 (3,350 GB/s
# HBM3), median 2,299: 0.69; its masked grouped GEMMs for MoE decode at M = 256 read 2,047-2,064
# GB/s (0.61). 0.69 for every weight and expert read a GEMM does; KV reads by the attention
# kernels keep HBM_EFFICIENCY (FlashMLA reports 3,000 GB/s on the same H800: 0.90).
GEMM_READ_EFFICIENCY = 0.69

# NVLink collectives and all-to-all: DeepEP measured 153-158 GB/s intranode dispatch/combine on
# H800, whose NVLink gives 200 GB/s each way (DeepEP README; H800 data sheet): 0.77.
NVLINK_EFFICIENCY = 0.77

# RDMA (InfiniBand/RoCE) bandwidth: DeepEP measured 43 GB/s at EP16 over 50 GB/s CX7 NDR NICs
# (DeepEP README, normal kernels): 0.86.
RDMA_EFFICIENCY = 0.86

# TCP over Ethernet (NCCL socket transport): iperf3 goodput on 10/25 GbE is ~94% of line rate
# before NCCL's own copies; 0.90.
ETHERNET_EFFICIENCY = 0.90

# PCIe Gen4/Gen5 x16 peer copies reach ~26 of 32 / ~52 of 64 GB/s in NVIDIA's bandwidthTest
# and nvbandwidth outputs: 0.80.
PCIE_EFFICIENCY = 0.80

# A fixed cost per kernel in a CUDA-graph-replayed decode step: launch and tail of one kernel
# is a few microseconds on Hopper (REFERENCE.md: "NVLink hop a few us"; small-kernel floors in
# nsys traces are 2-5 us). Assumed 3 us, times the kernels a decode step launches. An upper
# bound from this project's own H200 run (docs/gpus.md): a CUDA-graph replay of the
# Llama-3-8B-shaped batch-1 decode step took 5.11 ms against a 3.61 ms copy-bandwidth floor,
# 1.5 ms over ~426 kernels (32 layers x 13 + 10): at most 3.5 us a kernel, GEMV shortfall included.
KERNEL_OVERHEAD_S = 3e-6

# Kernels of one decode step, counted in atoll's own decode path (models/llama.py, models/deepseek.py,
# layers/mla.py, layers/moe.py, layers/router.py): a CPU decode step of tiny Llama, Qwen3-MoE,
# Qwen2-MoE and DeepSeek-V3 checkpoints (one rank) under torch.profiler, each outermost aten op
# that computes counted as one kernel (views and allocations as none), and each Triton entry point a
# GPU runs instead of its torch reference counted by its launches: rms_norm 1, rotary 1, paged decode
# attention 1, fused_moe 6. Collectives are not kernels here: collectives.py charges their latency.
KERNELS_NORMS = 2  # per layer: residual add + RMSNorm before attention and before the MLP (one Triton kernel each)
KERNELS_GQA_ATTENTION = 7  # qkv GEMM, rotary, K and V cache writes, paged attention, o-proj, one copy
KERNELS_QK_NORM = 2  # Qwen3's per-head q and k RMSNorm
# MLA decode (layers/mla.py): q_a, q_a norm, q_b, kv_a, kv_a norm, rope (4 cats: de-interleave, q_latent
# with q_rope, the cache entry), rotary, cache write, W_uk bmm, block gather, SDPA, W_uv bmm, o-proj, a copy
KERNELS_MLA_ATTENTION = 17
KERNELS_DENSE_MLP = 4  # gate/up GEMM, SiLU, multiply, down GEMM
KERNELS_MOE = 11  # routed experts: expert-locality mask (5 element-wise ops) and fused_moe (align 3, 2 grouped GEMMs, unpermute)
KERNELS_ROUTER = 5  # softmax top-k (Qwen3-MoE): gate GEMM, softmax, top-k, renormalising sum and divide
KERNELS_ROUTER_GROUPED = 18  # DeepSeek-V3: fp32 gate, sigmoid, bias, group scores and top-k, mask, top-k, gather, renormalise, scale
KERNELS_SHARED_EXPERT = 5  # a gated MLP (4) and its add to the routed output
KERNELS_SHARED_GATE = 3  # Qwen2-MoE's sigmoid gate on the shared expert: GEMM, sigmoid, multiply
KERNELS_PER_STEP = 10  # embedding, final norm, LM head, argmax, token index; rotary cos/sin and decode mask (4-7)

# Expert imbalance: (token, expert) pairs routed to the busiest EP rank over the mean (used by
# moe_cost.expert_imbalance, which carries it to each layout's experts per rank).
# TensorRT-LLM's tech blog 4, "Scaling Expert Parallelism in TensorRT-LLM (Part 1)", Table 1:
# DeepSeek-R1 on 32 GB200, EP32 with 8 experts per rank, a machine-translation dataset, local
# batch 256, no EPLB: imbalance ratio (max - mean) / mean by rank 1.564, averaged over layers
# and iterations, i.e. max / mean = 2.56 (with EPLB's redundant experts: 1.11). atoll places
# experts in contiguous blocks with no redundant copies (comm.routing.expert_split): the no-EPLB
# case. SGLang's large-scale EP blog (DeepSeek-V3 on 96 H100) agrees on the size: EPLB sped up
# prefill 1.49x and decode 2.54x there.
EXPERT_IMBALANCE = 2.56
MEASURED_EXPERTS_PER_RANK = 8  # the layout that figure was measured on (256 experts / EP32)
# The same table with EPLB's redundant experts placed by load (its "EPLB" row): max / mean 1.11.
# For an engine that balances experts so (SGLang's and DeepSeek's wide EP, TensorRT-LLM's EPLB), a
# workload's expert_imbalance takes this figure; atoll's own runtime has no redundant experts.
EXPERT_IMBALANCE_EPLB = 1.11
# The gate model fitted to the two figures above (planner/expert_balance.py, `fit(2.56, 1.11)`):
# each expert's share of the pairs log-normal with this spread, and the step's load drifting from
# the placement's window by a log-normal factor with the second.
SKEW_SIGMA = 1.05
DRIFT_SIGMA = 0.116

# Memory kept out of the KV cache on every GPU: AIConfigurator models a fixed ~3.5 GB "other"
# (CUDA context, CUDA graphs, allocator slack) plus communication buffers (REFERENCE.md).
RESERVE_BYTES = 3.5e9
# NCCL: default NCCL_BUFFSIZE 4 MiB x 2 (send, recv) x up to 32 channels per communicator.
NCCL_BUFFER_BYTES = 256 * 2**20
# Prefill is chunked: in steady serving a step carries up to the runtime's token budget of
# prompt tokens beside its decode tokens (planner/serving.py), the same default the runtime
# takes for the device (config.default_batched_tokens: vLLM's online-serving defaults, 8192 on
# GPUs of 70 GiB or more, as SGLang's on 80 GB+ GPUs too, and 2048 on smaller GPUs and CPUs).
PREFILL_CHUNK_TOKENS = default_batched_tokens(LARGE_DEVICE_GIB)  # the large-GPU figure, for the table


def prefill_chunk_tokens(gpu) -> int:
    """The step's token budget the runtime defaults to on this topology's device."""
    return default_batched_tokens(None if gpu.name == "cpu-core" else gpu.memory_gib)

# How far a prediction may be off: the band every predicted TPOT (and tokens/s) and TTFT carries
# where the topology holds no error measured by `atoll plan --check --record`. TPOT: issue 14's
# comparison with 22 published measurements (TensorRT-LLM, vLLM, NIM, SGLang, InferenceX) found
# predicted/measured throughput at a median of 1.24, within 1.5x on 15 of 22: +-25%.
# TTFT: the same comparison found TTFT 44 ms predicted against 331 ms measured at concurrency 25;
# with queueing for the prefill (planner/serving.py) 57 ms: +-50% is the least it can claim.
PREDICTION_BAND_TPOT = 0.25
PREDICTION_BAND_TTFT = 0.50

EFFICIENCY_LINK = {"nvlink": NVLINK_EFFICIENCY, "infiniband": RDMA_EFFICIENCY, "roce": RDMA_EFFICIENCY,
                   "ethernet": ETHERNET_EFFICIENCY, "pcie": PCIE_EFFICIENCY, "shm": PCIE_EFFICIENCY}


def link_efficiency(kind: str) -> float:
    return EFFICIENCY_LINK[kind]


def table() -> list[tuple[str, float, str]]:
    """(name, value, source) for the README and `atoll plan --explain`."""
    return [
        ("GEMM compute", GEMM_EFFICIENCY, "8192^3 bf16 matmul ~790/989 TFLOP/s on one H200 (measured)"),
        ("fp8 GEMM compute", FP8_GEMM_EFFICIENCY, "DeepGEMM README: 1350+ fp8 TFLOP/s on Hopper of 1,979"),
        ("prefill attention", ATTENTION_EFFICIENCY, "FlashAttention-3 on H100: 600-750/989 TFLOP/s"),
        ("HBM read", HBM_EFFICIENCY, "device copy ~4.3/4.8 TB/s on one H200 (measured)"),
        ("HBM read by a GEMM", GEMM_READ_EFFICIENCY, "DeepGEMM README: fp8 GEMMs at M=64/128 on H800, median "
                                                     "2,299 of 3,350 GB/s"),
        ("NVLink", NVLINK_EFFICIENCY, "DeepEP intranode 153-158 GB/s of H800's 200 GB/s"),
        ("InfiniBand/RoCE", RDMA_EFFICIENCY, "DeepEP internode 43 GB/s at EP16 of 50 GB/s NDR"),
        ("Ethernet (TCP)", ETHERNET_EFFICIENCY, "iperf3 goodput ~94% of 10/25 GbE line rate"),
        ("PCIe", PCIE_EFFICIENCY, "bandwidthTest/nvbandwidth ~26/32 GB/s Gen4 x16"),
        ("kernel floor (s)", KERNEL_OVERHEAD_S, "assumed; at most 3.5 us in atoll's own H200 graph replay"),
        ("kernels: norms per layer", KERNELS_NORMS, "counted: atoll decode step under torch.profiler"),
        ("kernels: GQA attention", KERNELS_GQA_ATTENTION, "counted: tiny Llama decode step"),
        ("kernels: q/k norm", KERNELS_QK_NORM, "counted: tiny Qwen3-MoE decode step"),
        ("kernels: MLA attention", KERNELS_MLA_ATTENTION, "counted: tiny DeepSeek-V3 decode step"),
        ("kernels: dense MLP", KERNELS_DENSE_MLP, "counted: tiny Llama decode step"),
        ("kernels: routed experts", KERNELS_MOE, "counted: tiny Qwen3-MoE/DeepSeek-V3, fused_moe's 6 launches"),
        ("kernels: softmax router", KERNELS_ROUTER, "counted: tiny Qwen3-MoE decode step"),
        ("kernels: grouped router", KERNELS_ROUTER_GROUPED, "counted: tiny DeepSeek-V3 decode step"),
        ("kernels: shared expert", KERNELS_SHARED_EXPERT, "counted: tiny DeepSeek-V3 decode step"),
        ("kernels: shared-expert gate", KERNELS_SHARED_GATE, "counted: tiny Qwen2-MoE decode step"),
        ("kernels: per step", KERNELS_PER_STEP, "counted: embedding, head, sampling, rotary tables"),
        ("expert imbalance", EXPERT_IMBALANCE, "TensorRT-LLM blog 4, Table 1: EP32 no EPLB, 8 experts/rank"),
        ("expert imbalance, EPLB", EXPERT_IMBALANCE_EPLB, "TensorRT-LLM blog 4, Table 1: EP32 with EPLB"),
        ("reserve (bytes)", RESERVE_BYTES, "AIConfigurator's fixed ~3.5 GB per GPU"),
        ("prefill chunk (tokens)", PREFILL_CHUNK_TOKENS, "the runtime's default step budget on GPUs of 70 GiB or "
                                                          "more (2048 on smaller GPUs and CPUs), vLLM's online default"),
        ("TPOT band", PREDICTION_BAND_TPOT, "issue 14: 22 published figures, median predicted/measured 1.24"),
        ("TTFT band", PREDICTION_BAND_TTFT, "issue 14: TTFT 57 ms predicted (44 before queueing) vs 331 measured"),
    ]
