"""One rank's compute, measured with the runtime's own code on one thread (a CPU rank is one
core, as the topology counts it):

- GEMM: `layers.packed.linear` (the runtime's F.linear) of x [rows, k] by weights [n, k],
  cycling through enough weights to pass the last-level cache, as a decode step streams its
  layers: at few rows this is the memory-bound rate a decode GEMM gets, at many the compute
  rate a prefill gets. TFLOP/s = 2 rows k n / seconds.
- Memory: `tensor.sum()` of a tensor larger than the caches, bytes read per second.
- Overhead: decode steps of tiny random checkpoints (calibrate.tiny) through ModelRunner and
  run_requests, at 1 and `layers` layers and 1 and `seqs` sequences, eager. The step's time
  beyond its FLOP/byte floor (its weight bytes / the measured bandwidth, its FLOPs / the GEMM
  rate at its rows) is split, by least squares over those runs, into a fixed part per tick, a
  part per sequence and a part per layer (dense; MoE from a qwen3_moe checkpoint).
"""

from __future__ import annotations

import contextlib
import io
import statistics
import time

GEMM_K, GEMM_N = 1024, 1024
ROWS = (1, 2, 4, 8, 16, 32, 64, 256, 1024)
PROBE_ROWS = 8
STREAM_BYTES = 128 * 2**20  # past the last-level cache of the servers atoll meets (32 MiB here)


def timed(fn, budget_s: float, least: int = 2) -> float:
    """Mean seconds of fn() over repeats filling budget_s (at least `least`), after one warm-up.
    The mean, not the median: on a machine shared with other jobs a sustained run loses the
    core for part of the time, and so do the runs the figures predict."""
    fn()
    count, t0 = 0, time.perf_counter()
    while count < least or time.perf_counter() - t0 < budget_s:
        fn()
        count += 1
        if count >= 200:
            break
    return (time.perf_counter() - t0) / count


def probe_tflops(budget_s: float = 0.5) -> float:
    """The machine's speed now, as the calibration's fp32 GEMM at 8 rows measures it."""
    import torch

    return gemm_tflops(torch.float32, budget_s, rows=(PROBE_ROWS,))[PROBE_ROWS]


def gemm_tflops(dtype, budget_s: float, rows=ROWS) -> dict[int, float]:
    import torch

    from atoll.layers.packed import linear

    itemsize = torch.empty(0, dtype=dtype).element_size()
    count = max(2, STREAM_BYTES // (GEMM_K * GEMM_N * itemsize))
    ws = [torch.randn(GEMM_N, GEMM_K).to(dtype) for _ in range(count)]
    out = {}
    with torch.inference_mode():
        for m in rows:
            x = torch.randn(m, GEMM_K).to(dtype)
            use = ws if m <= 64 else ws[:2]  # prefill sizes are compute-bound: no need to stream

            def run():
                for w in use:
                    linear(x, w)

            out[m] = 2 * m * GEMM_K * GEMM_N * len(use) / timed(run, budget_s) / 1e12
    return out


def read_gb_s(budget_s: float) -> float:
    import torch

    t = torch.ones(STREAM_BYTES // 4)
    return STREAM_BYTES / timed(lambda: t.sum(), budget_s, least=3) / 1e9


def decode_step_s(model_dir, *, seqs: int, out_tokens: int) -> float:
    """Median TPOT of `seqs` sequences of 8 prompt tokens through the runtime, eager, one rank."""
    from atoll.engine.generate import Request, run_requests
    from atoll.engine.runner import ModelRunner, RunSpec
    from atoll.engine.sampling import SamplingParams
    from atoll.parallel.mesh import ParallelContext

    spec = RunSpec(model_dir=str(model_dir), layout="TP1", max_num_seqs=seqs, max_model_len=8 + out_tokens,
                   max_num_batched_tokens=2048, enforce_eager=True)
    with contextlib.redirect_stderr(io.StringIO()):  # the cache summary line would break the progress bar
        runner = ModelRunner(spec, ParallelContext.single("cpu"))
    params = SamplingParams(max_tokens=out_tokens, ignore_eos=True)
    reqs = [Request(i, [(7 * i + j) % 200 + 1 for j in range(8)], params) for i in range(seqs)]
    run_requests(runner, reqs)  # warm-up
    runs = [run_requests(runner, reqs) for _ in range(2)]
    return statistics.median(r["metrics"]["tpot_s"] for res in runs for r in res)


def fit_overheads(samples: list[tuple[int, int, float]]) -> tuple[float, float, float]:
    """samples: (layers, seqs, seconds beyond the floor) -> (per tick, per sequence, per
    layer), least squares, each clipped at 0."""
    import torch

    a = torch.tensor([[1.0, s, n] for n, s, _ in samples], dtype=torch.float64)
    y = torch.tensor([[t] for _, _, t in samples], dtype=torch.float64)
    sol = torch.linalg.lstsq(a, y).solution.flatten().tolist()
    return tuple(max(0.0, v) for v in sol)


def floor_s(model_dir, seqs: int, bw: float, gemm) -> float:
    """A decode step's FLOP/byte floor: weight bytes over the read bandwidth, or FLOPs over the
    GEMM rate at its rows, whichever is more (the planner's roofline, from these figures)."""
    import json

    cfg = json.loads((model_dir / "config.json").read_text())
    from atoll.models.config import ModelConfig
    from atoll.planner.shapes import shapes

    s = shapes(ModelConfig.from_dict(cfg))
    params = s.active_params - s.embed
    return max(params * 4 / bw, 2 * seqs * params / gemm(seqs))
