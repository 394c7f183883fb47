"""atoll bench disagg: the same requests colocated and disaggregated, side by side in one run.

--requests prompts of --prompt-len random token ids (from --seed) generate --output-len
tokens each (greedy, ignore_eos), once on the --colocated layout and once as --prefill ->
--decode (engine.disagg.roles), each a fresh engine. Reported: wall time, median TTFT and TPOT, the
KV bytes sent with their analytic figure, and whether the tokens are identical. The decode
step runs eagerly on both sides. --kv-cache-dtype (both runs) sends the quantized cache as
stored. The 1-minute load average is read before and after.
"""

from __future__ import annotations

import random
import statistics
import time

import torch

from atoll import LLM, SamplingParams
from atoll.bench.harness import Run
from atoll.config.engine import KV_CACHE_DTYPES
from atoll.engine.disagg.transfer import analytic_bytes
from atoll.engine.rank.run_spec import resolve_dtype
from atoll.layers.kv_quant import kv_format
from atoll.parallel.layout import Layout


def add_parser(sub) -> None:
    p = sub.add_parser("disagg", help="colocated vs disaggregated prefill/decode: wall time, TTFT, TPOT, KV sent",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the demo model, SmolLM2-135M)")
    p.add_argument("--colocated", default="PP2", help="the colocated layout (default PP2: the same two ranks)")
    p.add_argument("--prefill", default="TP1", help="the prefill engine's layout (default TP1)")
    p.add_argument("--decode", default="TP1", help="the decode engine's layout (default TP1)")
    p.add_argument("--requests", type=int, default=8, help="requests (default 8)")
    p.add_argument("--prompt-len", type=int, default=256, help="prompt tokens per request (default 256)")
    p.add_argument("--output-len", type=int, default=16, help="generated tokens per request (default 16)")
    p.add_argument("--seed", type=int, default=0, help="prompt seed (default 0)")
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="both runs' KV cache storage (default auto: the compute dtype)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run)


def run(args) -> int:
    bench = Run(args.model, quiet=args.json)
    rng = random.Random(args.seed)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True)
    runs = {}
    for name, kw in (("colocated " + args.colocated, {"layout": args.colocated}),
                     (f"{args.prefill} -> {args.decode}", {"prefill": args.prefill, "decode": args.decode})):
        llm = LLM(bench.model, enforce_eager=True, kv_cache_dtype=args.kv_cache_dtype, **kw)
        vocab = llm.config.vocab_size
        rng.seed(args.seed)
        prompts = [[rng.randrange(vocab) for _ in range(args.prompt_len)] for _ in range(args.requests)]
        start = time.perf_counter()  # a fresh engine each: its start is in the wall time, as before
        with llm:  # its ranks end before the next side starts
            outs = llm.generate(prompts, params)
        runs[name] = {"wall_s": time.perf_counter() - start,
                      "ttft_s": statistics.median(o.metrics["ttft_s"] for o in outs),
                      "tpot_s": statistics.median(o.metrics["tpot_s"] for o in outs),
                      "kv_mib": sum(o.metrics.get("kv_bytes_sent", 0) for o in outs) / 2**20,
                      "tokens": [o.token_ids for o in outs]}
    first, second = runs.values()

    itemsize = resolve_dtype(llm.options.dtype, llm.config, torch.device("cpu")).itemsize  # the CPU ranks' dtype
    fmt = kv_format(args.kv_cache_dtype)
    itemsize, scale_bytes = (itemsize, 0) if fmt is None else (fmt.itemsize, fmt.scale_bytes)
    report = {"runs": {k: {f: v for f, v in r.items() if f != "tokens"} for k, r in runs.items()},
              "analytic_kv_mib": args.requests * analytic_bytes(llm.config, Layout.parse(args.decode),
                                                                args.prompt_len, itemsize, scale_bytes) / 2**20,
              "identical": first["tokens"] == second["tokens"]}
    bench.note()
    bench.emit(report, as_json=args.json, render=render, indent=None)  # one line
    return 0


def render(report: dict) -> None:
    print(f"{'':26s}{'wall (s)':>10s}{'TTFT med (s)':>14s}{'TPOT med (s)':>14s}{'KV sent (MiB)':>15s}")
    for name, r in report["runs"].items():
        print(f"{name:26s}{r['wall_s']:10.2f}{r['ttft_s']:14.3f}{r['tpot_s']:14.4f}{r['kv_mib']:15.2f}")
    print(f"analytic KV {report['analytic_kv_mib']:.2f} MiB; tokens identical: "
          f"{'yes' if report['identical'] else 'NO'}; load average (1 min) {report['load_avg_1m'][0]:.2f} "
          f"before, {report['load_avg_1m'][-1]:.2f} after, on {report['cores']} cores")
