"""One rank's compute, measured with the runtime's own code on the rank's device (a CPU rank
is one core on one thread, as the topology counts it; a GPU rank is one GPU):

- GEMM: `layers.packed.linear` (the runtime's F.linear) of x [rows, k] by weights [n, k],
  cycling through enough weights to pass the last-level cache (the GPU's L2), as a decode
  step streams its layers: at few rows this is the memory-bound rate a decode GEMM gets, at
  many the compute rate a prefill gets. TFLOP/s = 2 rows k n / seconds. On a GPU k = n =
  8192 (a large model's hidden size: smaller products leave the tensor cores idle).
- Memory: `tensor.sum()` of a tensor larger than the caches, bytes read per second; on a GPU
  also `copy_` (bytes read + written per second).
- Overhead: decode steps of tiny random checkpoints (calibrate.tiny) through ModelRunner and
  run_batch, at 1 and `layers` layers and 1 and `seqs` sequences, eager. The step's time
  beyond its FLOP/byte floor (its weight bytes / the measured bandwidth, its FLOPs / the GEMM
  rate at its rows) is split, by least squares over those runs, into a fixed part per tick, a
  part per sequence and a part per layer (dense; MoE from a qwen3_moe checkpoint).

Every timing takes the device and synchronizes it (calibrate.timing), so a GPU's queued
work is counted, not only its launches.
"""

from __future__ import annotations

import contextlib
import io
import json
import statistics

import torch

from atoll.calibrate.timing import is_cuda, sync, timed
from atoll.engine.batch.request import Request
from atoll.engine.rank.loop import run_batch
from atoll.engine.rank.run_spec import RunSpec
from atoll.engine.rank.runner import ModelRunner
from atoll.engine.sample.sampler import SamplingParams
from atoll.layers.packed import linear
from atoll.models.config import ModelConfig
from atoll.parallel.mesh import ParallelContext
from atoll.planner.shapes import shapes

GEMM_K, GEMM_N = 1024, 1024
ROWS = (1, 2, 4, 8, 16, 32, 64, 256, 1024)
PROBE_ROWS = 8
STREAM_BYTES = 128 * 2**20  # past the last-level cache of the servers atoll meets (32 MiB here)
# a GPU: a large model's hidden size, rows from one decode token to a long prefill chunk, and
# weights past any L2 (50 MiB on H100/H200, 126 MiB on B200)
GPU_K, GPU_N = 8192, 8192
GPU_ROWS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
GPU_STREAM_BYTES = 2**30


def shape_for(device) -> tuple[int, int]:
    """(k, n) of the calibration's GEMMs on `device`."""
    return (GPU_K, GPU_N) if is_cuda(device) else (GEMM_K, GEMM_N)


def stream_bytes_for(device) -> int:
    return GPU_STREAM_BYTES if is_cuda(device) else STREAM_BYTES


def probe_tflops(budget_s: float = 0.5) -> float:
    """The machine's speed now, as the calibration's fp32 GEMM at 8 rows measures it."""
    return gemm_tflops(torch.float32, budget_s, rows=(PROBE_ROWS,))[PROBE_ROWS]


def gemm_tflops(dtype, budget_s: float, rows=ROWS, *, device="cpu", shape=None,
                stream_bytes: int | None = None) -> dict[int, float]:
    """TFLOP/s of x [rows, k] @ w.T, w [n, k] of `dtype`, for each row count, on `device`."""
    k, n = shape or shape_for(device)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    count = max(2, (stream_bytes or stream_bytes_for(device)) // (k * n * itemsize))
    ws = [torch.randn(n, k, device=device).to(dtype) for _ in range(count)]
    out = {}
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, k, device=device).to(dtype)
            # a CPU's prefill sizes are compute-bound: no need to stream; a GPU's stay
            # memory-bound up to hundreds of rows, and its whole stream takes milliseconds
            use = ws if m <= 64 or is_cuda(device) else ws[:2]

            def run():
                for w in use:
                    linear(x, w)

            out[m] = 2 * m * k * n * len(use) / timed(run, budget_s, device=device) / 1e12
    return out


def read_gb_s(budget_s: float, *, device="cpu", nbytes: int | None = None) -> float:
    """GB/s read by `tensor.sum()` of a tensor past the caches."""
    nbytes = nbytes or stream_bytes_for(device)
    t = torch.ones(nbytes // 4, device=device)
    return t.numel() * 4 / timed(lambda: t.sum(), budget_s, least=3, device=device) / 1e9


def copy_gb_s(budget_s: float, *, device="cpu", nbytes: int | None = None) -> float:
    """GB/s moved (read + written) by `dst.copy_(src)` of tensors past the caches."""
    nbytes = nbytes or stream_bytes_for(device)
    src = torch.ones(nbytes // 4, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() * 4 / timed(lambda: dst.copy_(src), budget_s, least=3, device=device) / 1e9


def decode_step_s(model_dir, *, seqs: int, out_tokens: int, device="cpu") -> float:
    """Median TPOT of `seqs` sequences of 8 prompt tokens through the runtime, eager, one rank
    on `device`. Each tick hands its sampled tokens to the host (engine.rank.loop), which waits
    for the device, so the TPOT holds the GPU's work as well as its launches."""
    # a GPU's cache is sized to what the requests need, not to 90% of its memory
    blocks = seqs * -(-(8 + out_tokens) // 16) + 2 if is_cuda(device) else None
    spec = RunSpec.of(model_dir=str(model_dir), layout="TP1", max_num_seqs=seqs, max_model_len=8 + out_tokens,
                   max_num_batched_tokens=2048, enforce_eager=True, num_blocks=blocks,
                   device="cuda" if is_cuda(device) else "cpu")
    with contextlib.redirect_stderr(io.StringIO()):  # the cache summary line would break the progress bar
        runner = ModelRunner(spec, ParallelContext.single(device))
    params = SamplingParams(max_tokens=out_tokens, ignore_eos=True)
    reqs = [Request(i, [(7 * i + j) % 200 + 1 for j in range(8)], params) for i in range(seqs)]
    run_batch(runner, reqs)  # warm-up
    sync(device)
    runs = [run_batch(runner, reqs) for _ in range(2)]
    return statistics.median(r["metrics"]["tpot_s"] for res in runs for r in res)


def fit_overheads(samples: list[tuple[int, int, float]]) -> tuple[float, float, float, float]:
    """samples: (layers, seqs, seconds beyond the floor) -> (per tick, per sequence, per
    layer, per sequence in each layer), least squares, each clipped at 0. The last is the
    part of a layer that grows with the batch beyond its products: attention over each
    sequence's cache (the block gather and SDPA), the activations' element-wise ops."""
    a = torch.tensor([[1.0, s, n, s * n] for n, s, _ in samples], dtype=torch.float64)
    y = torch.tensor([[t] for _, _, t in samples], dtype=torch.float64)
    sol = torch.linalg.lstsq(a, y).solution.flatten().tolist()
    return tuple(max(0.0, v) for v in sol)


def floor_s(model_dir, seqs: int, bw: float, gemm) -> float:
    """A decode step's FLOP/byte floor: weight bytes over the read bandwidth, or FLOPs over the
    GEMM rate at its rows, whichever is more (the planner's roofline, from these figures)."""
    cfg = json.loads((model_dir / "config.json").read_text())
    s = shapes(ModelConfig.from_dict(cfg))
    params = s.active_params - s.embed
    return max(params * 4 / bw, 2 * seqs * params / gemm(seqs))
