"""The simulator's closed loop on this machine: `atoll bench serve --compare-plan` over eight
scenarios, one after another, each printing the measured figures beside the simulated ones for
the same command line; then the table the README shows (measured / simulated for p50 TTFT,
p50 TPOT, p90 TPOT and goodput, and measured / the analytic planner's mean TTFT and TPOT beside
them), the median and worst |error| of each.

    python examples/closed_loop.py --topology calibrated.yaml [--model DIR] [--out runs.json]

Each run first times a probe of the machine's speed against the calibration and simulates with
the steps scaled by it (bench/serve_probe.py); the last row gives the medians without it.
The topology should be one `atoll calibrate --steps MODEL --step-layouts "TP1,PP2,2 x TP1"`
wrote for the same model, so the simulator times the model's own measured steps.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
from pathlib import Path

COMMON = ["--num-prompts", "40", "--input-len", "128", "--output-len", "32", "--goodput", "ttft:2000", "tpot:200"]
SCENARIOS = {
    "TP1, 1 req/s": ["--request-rate", "1"],
    # near saturation: about 80% of the rate at which this engine's queue grows without bound
    # (at 2.5 req/s it is saturated, and its measured TPOT moved 3.5x between two runs)
    "TP1, 2 req/s (near saturation)": ["--request-rate", "2"],
    "TP2, 1 req/s (8-head model)": ["-tp", "2", "--request-rate", "1"],
    "PP2, 1 req/s": ["-pp", "2", "--request-rate", "1"],
    "PP2, 2 req/s": ["-pp", "2", "--request-rate", "2"],
    "2 x TP1, cache-aware, shared prefixes": ["-dp", "2", "--prompts", "shared-prefix", "--input-len", "256",
                                              "--system-prompts", "4", "--user-len", "32", "--request-rate", "1.5"],
    "1P1D, 10% long prompts": ["--prefill", "TP1", "--decode", "TP1", "--prompts", "long-mix", "--input-len", "64",
                               "--long-len", "1024", "--long-share", "0.1", "--disagg-min-prompt-tokens", "512",
                               "--request-rate", "1"],
    "TP1, n-gram speculation": ["--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
                                "--request-rate", "1"],
    "TP1, closed loop of 4": ["--max-concurrency", "4"],
}
FIGURES = ("ttft_p50", "tpot_p50", "tpot_p90", "goodput")
DEFAULT_MODEL = Path("~/.cache/atoll/SmolLM2-135M-Instruct").expanduser()


def make_tp2_model(out: Path, base: Path = DEFAULT_MODEL) -> None:
    """SmolLM2-135M's shape with 8 heads of 64 and 4 KV heads (hidden 512), random weights
    (seed 0), float32, with SmolLM2's tokenizer: a model TP2 divides."""
    import torch  # lazy: only this one-off step builds a model
    from transformers import AutoConfig, AutoModelForCausalLM  # lazy: as torch

    config = json.loads((base / "config.json").read_text())
    config.update(hidden_size=512, num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    config = AutoConfig.for_model(**{k: v for k, v in config.items() if k not in ("architectures", "dtype",
                                                                                 "transformers_version")})
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (base / name).exists():
            shutil.copy(base / name, out / name)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", default=None, help="a topology `atoll calibrate --steps` wrote (required to run)")
    p.add_argument("--model", default=None)
    p.add_argument("--out", default=None, help="write every run's JSON here")
    p.add_argument("--resume", default=None, help="a --out file of runs already made: only the others run")
    p.add_argument("--tp2-model", default="~/.cache/atoll/closed-loop-8-heads", help="the TP2 scenario's model")
    p.add_argument("--make-tp2-model", metavar="DIR", default=None, help="make the TP2 scenario's model in DIR, then stop")
    args = p.parse_args()
    if args.make_tp2_model:
        make_tp2_model(Path(args.make_tp2_model).expanduser())
        return 0
    if args.topology is None:
        p.error("--topology is required to run the scenarios")
    runs = {}
    if args.resume:
        with open(args.resume) as f:
            runs = {k: v for k, v in json.load(f).items() if k in SCENARIOS}
    for name, flags in SCENARIOS.items():
        if name in runs:
            continue
        model = str(Path(args.tp2_model).expanduser()) if "-tp" in flags else args.model
        cmd = [sys.executable, "-m", "atoll", "bench", "serve", "--json", "--compare-plan", "--topology",
               args.topology, *(["--model", model] if model else []), *COMMON, *flags]
        print(f"== {name}: {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=1200)
        if done.returncode != 0:
            print(done.stderr[-2000:], file=sys.stderr)
            return 1
        runs[name] = json.loads(done.stdout)
        if args.out:  # after every run: a later failure keeps the runs made
            with open(args.out, "w") as f:
                json.dump(runs, f, indent=1)
        x = runs[name]["plan"]["measured_over_simulated"]
        print("   measured / simulated: " + ", ".join(f"{k} {x.get(k)}" for k in FIGURES), file=sys.stderr, flush=True)
    print("| scenario | " + " | ".join(FIGURES) + " | analytic ttft | analytic tpot | speed probe / round | load |")
    print("|---" * (len(FIGURES) + 5) + "|")
    errors: dict[str, list[float]] = {k: [] for k in FIGURES}
    plain: dict[str, list[float]] = {k: [] for k in FIGURES}  # the calibration as it is, without the probe
    analytic: dict[str, list[float]] = {"ttft": [], "tpot": []}
    for name, r in runs.items():
        x = dict(r["plan"]["measured_over_simulated"])
        m, sim = (r["serve"]["goodput"]["request_goodput"],
                  r["plan"]["simulated"]["serve"]["goodput"]["request_goodput"])
        if not m and not sim:
            x["goodput"] = "neither met the SLOs"  # no ratio, no error counted
        elif not sim:
            x["goodput"] = "measured some, simulated none"
            errors["goodput"].append(1.0)  # counted as a 100% error (it is unbounded)
        for k in FIGURES:
            if isinstance(x.get(k), (int, float)):  # 0: measured none where the simulation had some, a 100% error
                errors[k].append(abs(x[k] - 1))
        u = r["plan"].get("measured_over_simulated_uncorrected") or r["plan"]["measured_over_simulated"]
        for k in FIGURES:
            if isinstance(u.get(k), (int, float)):
                plain[k].append(abs(u[k] - 1))
        sp = r["plan"].get("speed") or {}
        speed = f"{sp['factor']:.3g} / {sp['during_run']:.3g}" if sp.get("factor") and sp.get("during_run") else "-"
        a = r["plan"].get("measured_over_predicted") or {}  # the analytic planner's means, for comparison
        for k in ("ttft", "tpot"):
            if isinstance(a.get(k), (int, float)):
                analytic[k].append(abs(a[k] - 1))
        print(f"| {name} | " + " | ".join(f"{x.get(k)}" for k in FIGURES)
              + f" | {a.get('ttft')} | {a.get('tpot')} | {speed} | {r.get('load_avg_1m')} |")
    for what, f in (("median", statistics.median), ("worst", max)):
        print(f"| {what} abs error | " + " | ".join(f"{f(v):.1%}" if v else "-"
                                                  for v in [*errors.values(), *analytic.values()]) + " | | |")
    print("| median abs error, no speed probe | " + " | ".join(f"{statistics.median(v):.1%}" if v else "-"
                                                            for v in plain.values()) + " | | | | |")
    print(f"({os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
