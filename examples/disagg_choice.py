"""DistServe's lesson at this machine's scale: the SLO search (`atoll plan --goodput`) picks
disaggregation for a prefill-heavy load and colocated replicas for a short-prompt load; then
`atoll bench serve` runs the search's choice and the best deployment of the other kind at the
same request rate, and the measured goodput says which was right.

    python examples/disagg_choice.py --topology calibrated.yaml [--model DIR] [--out runs.json]

The topology should be one `atoll calibrate --steps` wrote for the model (its TP1, PP2 and
"2 x TP1" steps), so the search times the model's measured steps.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys

from atoll.parallel.layout import Layout

# (name, the search's and the bench's load flags, SLOs)
LOADS = {
    "prefill-heavy (768 in, 64 out)": (["--isl", "768", "--osl", "64"], ["--input-len", "768", "--output-len", "64"],
                                       ["ttft:6000", "tpot:100"]),
    "short prompts (32 in, 256 out)": (["--isl", "32", "--osl", "256"], ["--input-len", "32", "--output-len", "256"],
                                       ["ttft:2000", "tpot:100"]),
}
NUM_PROMPTS = 40


def flags(deployment: str) -> list[str]:
    """`bench serve`'s engine flags for a deployment as the search names it."""
    m = re.fullmatch(r"(\d+)P(\d+)D \((.+) prefill, (.+) decode\)", deployment)
    if m:
        return ["--prefill", m.group(3), "--decode", m.group(4), "--prefill-replicas", m.group(1),
                "--decode-replicas", m.group(2)]
    m = re.fullmatch(r"(\d+) x (.+)", deployment)
    if not m:
        raise ValueError(f"unknown deployment {deployment!r}")
    # a dense model's replicas are its layout's dp, as atoll serve takes them
    lay, replicas = Layout.parse(m.group(2)), int(m.group(1))
    return ["--layout", str(Layout(tp=lay.tp, pp=lay.pp, cp=lay.cp, dp=replicas, moe_tp=lay.tp * replicas))]


def kind(deployment: str) -> str:
    return "xPyD" if "P" in deployment.split(" ")[0] else "colocated"


def run(cmd: list[str]) -> dict:
    print("$ atoll " + " ".join(cmd[3:]), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    if done.returncode not in (0, 1) or not done.stdout.strip():
        raise SystemExit(done.stderr[-2000:])
    return json.loads(done.stdout)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--topology", required=True)
    p.add_argument("--model", default=os.path.expanduser("~/.cache/atoll/SmolLM2-135M-Instruct"))
    p.add_argument("--out", default=None, help="write the searches and runs as JSON here")
    args = p.parse_args()
    atoll = [sys.executable, "-m", "atoll"]
    out = {}
    for name, (plan_load, bench_load, slos) in LOADS.items():
        found = run(atoll + ["plan", "--model", args.model, "--topology", args.topology, "--goodput", *slos,
                             *plan_load, "--num-prompts", str(NUM_PROMPTS), "--format", "json", "--no-progress"])
        rows = [r for r in found["deployments"] if r["meets"]]
        if not rows:
            print(f"{name}: no deployment meets {' '.join(slos)}", file=sys.stderr)
            return 1
        chosen = rows[0]
        other = next((r for r in found["deployments"] if kind(r["deployment"]) != kind(chosen["deployment"])), None)
        rate = round(chosen["rate"], 2)
        runs = {}
        for role, row in (("chosen", chosen), ("other", other)):
            if row is None:
                continue
            bench = run(atoll + ["bench", "serve", "--json", "--model", args.model, *flags(row["deployment"]),
                                 "--max-num-seqs", str(row["max_num_seqs"]), *bench_load,
                                 "--num-prompts", str(NUM_PROMPTS), "--request-rate", str(rate), "--goodput", *slos])
            good, serve = bench["serve"]["goodput"], bench["serve"]
            runs[role] = {"deployment": row["deployment"], "max_num_seqs": row["max_num_seqs"],
                          "searched_goodput": row["rate"], "measured_goodput": good["request_goodput"],
                          "measured_attainment": good["attainment"],
                          "measured_p90_ms": {k: serve[f"{k}_ms"]["p90"] for k in ("ttft", "tpot")},
                          "searched_p90_ms": {"ttft": row["p90_ttft_ms"], "tpot": row["p90_tpot_ms"]},
                          "load_avg_1m": bench.get("load_avg_1m")}
        out[name] = {"slos": slos, "rate": rate, "search": found, "runs": runs}
        if args.out:
            with open(args.out, "w") as f:
                json.dump(out, f, indent=1)
    print("| load | SLOs | rate req/s | deployment | search's pick | searched goodput req/s | measured goodput req/s "
          "| measured attainment | p90 TTFT / TPOT ms measured (searched) | load |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name, o in out.items():
        for role in ("chosen", "other"):
            r = o["runs"].get(role)
            if r:
                m, p = r["measured_p90_ms"], r["searched_p90_ms"]
                print(f"| {name} | {' '.join(o['slos'])} | {o['rate']:g} | {r['deployment']} | "
                      f"{'yes' if role == 'chosen' else 'no'} | {r['searched_goodput']:.3g} | "
                      f"{r['measured_goodput']:.3g} | {r['measured_attainment']:.3g} | "
                      f"{m['ttft']:.0f} / {m['tpot']:.0f} ({p['ttft']:.0f} / {p['tpot']:.0f}) | {r['load_avg_1m']} |")
    print(f"({os.cpu_count()} cores)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
