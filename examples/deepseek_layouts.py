"""The card's question through the simulator: DeepSeek-V3 on 2 x 8 H200, TP8PP2 against EP16
(DP16EP16: attention data-parallel, experts over 16 ranks) at one request in flight and at 256,
then the SLO search's answer for a chat load (ISL 2048, OSL 256, 90% of requests within TTFT
2 s and TPOT 50 ms) at three request rates, each with its why.

    python examples/deepseek_layouts.py [--rates 2,10,30]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

BASE = ["--model", "DeepSeek-V3", "--topology", "dgx-h200", "--nodes", "2"]
LOAD = ["--input-len", "2048", "--output-len", "256"]
LAYOUTS = ("TP8PP2", "DP16EP16")


def atoll(*args: str) -> str:
    done = subprocess.run([sys.executable, "-m", "atoll", *args], capture_output=True, text=True, timeout=900)
    if done.returncode not in (0, 1):
        raise SystemExit(done.stderr[-2000:])
    return done.stdout


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rates", default="2,10,30")
    args = p.parse_args()
    print("| layout | in flight | TPOT p50 ms | tok/s per user | output tok/s (16 GPUs) | its steps are bound by |")
    print("|---|---|---|---|---|---|")
    for layout in LAYOUTS:
        for flight in (1, 256):
            out = json.loads(atoll("simulate", *BASE, "--layout", layout, *LOAD, "--request-rate", "inf",
                                   "--max-concurrency", str(flight), "--num-prompts", str(max(16, 4 * flight)),
                                   "--json", "--no-progress"))
            s, e = out["serve"], out["engines"][0]
            tpot = s["tpot_ms"]["p50"]
            bound = ", ".join(f"{b['what']} {b['share']:.0%}" for b in e["bound_by"][:2])
            print(f"| {layout} | {flight} | {tpot:.1f} | {1e3 / tpot:.0f} | {s['output_throughput']:.0f} | {bound} |")
    for rate in args.rates.split(","):
        print(f"\n### {rate} requests/s\n")
        text = atoll("plan", *BASE, "--goodput", "ttft:2000", "tpot:50", "--isl", "2048", "--osl", "256",
                     "--request-rate", rate, "--no-progress")
        print("```\n" + text.rstrip() + "\n```")
    return 0


if __name__ == "__main__":
    sys.exit(main())
