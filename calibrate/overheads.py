"""The per-step overheads both calibrations fit (CPU and GPU): eager decode steps of tiny
checkpoints beyond their floor at the measured read bandwidth and GEMM rates."""

from __future__ import annotations

import tempfile
from pathlib import Path

from atoll.calibrate import compute
from atoll.calibrate.tiny import write_tiny
from atoll.topologies.calibration import Calibration

DTYPES = {"fp32": "float32", "bf16": "bfloat16"}  # the planner's name -> the runtime's (config.DTYPES)


def measure_overheads(cal: dict, bw: float, *, quick: bool, device, bar) -> None:
    """cal["overhead_us"] from eager decode steps of tiny checkpoints on `device` (see
    calibrate.compute), beyond their floor at read bandwidth `bw` (bytes/s) and the fp32 GEMM
    rates in cal["gemm_tflops"] (the tiny checkpoints are float32)."""
    rates = Calibration.from_dict({"gemm_tflops": cal["gemm_tflops"]})

    def gemm(m):
        return rates.gemm_flops("fp32", m)

    with tempfile.TemporaryDirectory(prefix="atoll-calibrate-") as tmp:
        out_tokens = 6 if quick else 24
        for kind, moe in (("dense", False), ("moe", True)):
            bar.set_postfix_str(f"overhead {kind}")
            samples = []
            for layers in (1, 5):
                d = compute_dir(Path(tmp), layers, moe)
                for seqs in ((1, 8) if not moe else (8,)):
                    step = compute.decode_step_s(d, seqs=seqs, out_tokens=out_tokens, device=device)
                    samples.append((layers, seqs, max(0.0, step - compute.floor_s(d, seqs, bw, gemm))))
            if not moe:
                tick, per_seq, per_layer, seq_layer = compute.fit_overheads(samples)
                cal["overhead_us"] |= {"step": round(tick * 1e6, 1), "per_seq": round(per_seq * 1e6, 2),
                                       "dense_layer": round(per_layer * 1e6, 2), "seq_layer": round(seq_layer * 1e6, 3)}
            else:  # the tick and per-sequence parts as the dense runs; per MoE layer the slope,
                # less the per-sequence part of its attention (the dense fit's)
                (n0, s, t0), (n1, _, t1) = samples
                attn = cal["overhead_us"].get("seq_layer", 0.0) * 1e-6 * s
                cal["overhead_us"]["moe_layer"] = round(max(0.0, (t1 - t0) / (n1 - n0) - attn) * 1e6, 2)
            bar.update()


def compute_dir(tmp: Path, layers: int, moe: bool) -> Path:
    d = tmp / f"{'moe' if moe else 'dense'}-{layers}"
    return d if (d / "config.json").exists() else write_tiny(d, layers=layers, moe=moe)

