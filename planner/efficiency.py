"""Every efficiency factor and fixed cost of the cost model, in one place, with its source.

A factor multiplies a peak from the topology (data-sheet TFLOPS, HBM or link bandwidth) to
give what kernels reach. None is fitted to the predictions the tests check; each comes from
a measurement or a published figure named beside it.
"""

# Dense GEMM: 8192^3 bf16 matmul measured at ~790 of 989 TFLOP/s on one H200 (REFERENCE.md,
# measured on this project's machine): 0.80. Used for prefill and any compute-bound GEMM.
GEMM_EFFICIENCY = 0.80

# Attention core in prefill (FlashAttention-style): FlashAttention-3 reports ~600-750 of 989
# TFLOP/s bf16 on H100 for long sequences; 0.60 is the lower end, as prompts here are ~1k tokens.
ATTENTION_EFFICIENCY = 0.60

# HBM streaming: device-to-device copy measured at ~4.3 of 4.8 TB/s on one H200 (REFERENCE.md):
# 0.90. Decode GEMMs and attention over the KV cache are reads of this kind.
HBM_EFFICIENCY = 0.90

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
# nsys traces are 2-5 us). Assumed 3 us, times the kernels of one decoder layer.
KERNEL_OVERHEAD_S = 3e-6
KERNELS_PER_LAYER = 8  # norm, qkv, attention, o-proj, norm, gate/up, activation, down
KERNELS_PER_MOE = 4  # router, top-k, grouped GEMM x2 (and permute) on top of the above

# Memory kept out of the KV cache on every GPU: AIConfigurator models a fixed ~3.5 GB "other"
# (CUDA context, CUDA graphs, allocator slack) plus communication buffers (REFERENCE.md).
RESERVE_BYTES = 3.5e9
# NCCL: default NCCL_BUFFSIZE 4 MiB x 2 (send, recv) x up to 32 channels per communicator.
NCCL_BUFFER_BYTES = 256 * 2**20
# Prefill is chunked: SGLang's default chunked-prefill size on 80 GB+ GPUs is 8192 tokens.
PREFILL_CHUNK_TOKENS = 8192

# How far a prediction may be off: the band every predicted TPOT (and tokens/s) and TTFT carries
# where the topology holds no error measured by `atoll plan --check --record`. TPOT: issue 14's
# comparison with 22 published measurements (TensorRT-LLM, vLLM, NIM, SGLang, InferenceX) found
# predicted/measured throughput at a median of 1.24, within 1.5x on 15 of 22: +-25%.
# TTFT: the same comparison found TTFT 44 ms predicted against 331 ms measured at concurrency 25
# (no queueing in the model): +-50% is the least it can claim.
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
        ("prefill attention", ATTENTION_EFFICIENCY, "FlashAttention-3 on H100: 600-750/989 TFLOP/s"),
        ("HBM read", HBM_EFFICIENCY, "device copy ~4.3/4.8 TB/s on one H200 (measured)"),
        ("NVLink", NVLINK_EFFICIENCY, "DeepEP intranode 153-158 GB/s of H800's 200 GB/s"),
        ("InfiniBand/RoCE", RDMA_EFFICIENCY, "DeepEP internode 43 GB/s at EP16 of 50 GB/s NDR"),
        ("Ethernet (TCP)", ETHERNET_EFFICIENCY, "iperf3 goodput ~94% of 10/25 GbE line rate"),
        ("PCIe", PCIE_EFFICIENCY, "bandwidthTest/nvbandwidth ~26/32 GB/s Gen4 x16"),
        ("kernel floor (s)", KERNEL_OVERHEAD_S, "assumed: a few us per graph-replayed kernel"),
        ("reserve (bytes)", RESERVE_BYTES, "AIConfigurator's fixed ~3.5 GB per GPU"),
        ("TPOT band", PREDICTION_BAND_TPOT, "issue 14: 22 published figures, median predicted/measured 1.24"),
        ("TTFT band", PREDICTION_BAND_TTFT, "issue 14: TTFT 44 ms predicted vs 331 ms measured (queueing)"),
    ]
