"""atoll bench: benchmarks that print ratios measured side by side in one run.

Each benchmark is a module in BENCHES with `add_parser(subparsers)` that adds its own parser and
`set_defaults(run=...)`; `atoll bench NAME --help` lists its options. Plain `atoll bench` (no
name) is the model bench (bench/model.py, also `atoll bench model`): its options are the
`bench` parser's own, so `atoll bench --batch 1` works.
"""

from __future__ import annotations

import argparse
import importlib

from atoll.bench import model as bench_model

# benchmark name -> (module, its one-line help). `atoll bench --help` lists these from here; only
# the benchmarks a command line names are imported (tests/cli check each line is its module's own)
BENCHES = {
    "model": ("atoll.bench.model", "atoll vs transformers generate, decode vs bandwidth floor (the default)"),
    "dispatch": ("atoll.bench.dispatch", "MoE dispatch+combine time over a bare all_to_all of the same bytes"),
    "exchange": ("atoll.bench.exchange", "MoE all_to_all dispatch vs gather_combine, per rows per rank"),
    "eplb": ("atoll.bench.eplb", "MoE expert load balancing: load, dispatch bytes and step time before and after "
                                 "a rebalance"),
    "tbo": ("atoll.bench.two_batch", "MoE two-batch overlap off vs on: step time by tokens per step, the crossover"),
    "kernels": ("atoll.bench.kernels", "Triton kernels vs torch reference vs device floor"),
    "prefix": ("atoll.bench.prefix", "prefix caching off vs on: prefill tokens computed and TTFT"),
    "disagg": ("atoll.bench.disagg", "colocated vs disaggregated prefill/decode: wall time, TTFT, TPOT, KV sent"),
    "serve": ("atoll.bench.serve", "an OpenAI-compatible server under load: throughput, TTFT, TPOT, ITL, "
                                   "goodput (vLLM's serving benchmark)"),
    "startup": ("atoll.bench.startup", "atoll generate (default, --enforce-eager) and transformers, start-up "
                                       "and compile included, first and second run"),
    "spec": ("atoll.bench.spec", "speculative decoding off vs on: tokens/s, acceptance"),
    "structured": ("atoll.bench.structured", "a JSON schema's cost: tokens/s with and without, grammar compile time"),
}


def add_parser(sub, argv: list[str] | None = None) -> None:
    """The `bench` parser. `argv` (the words after `bench`) picks the benchmarks built from their
    modules: every one it names (a word that is an option's value included, harmless: one more
    import); the others are their line of BENCHES. No argv: every benchmark is built."""
    p = sub.add_parser(
        "bench", help="benchmarks (atoll bench [model options] | atoll bench dispatch ...)",
        description="Benchmarks that time atoll against a baseline in the same run and print "
                    "the ratio. With no name: the model bench (atoll vs transformers, decode vs "
                    "bandwidth floor). Named: " + ", ".join(BENCHES) + ".",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_model.add_arguments(p)
    p.set_defaults(run=bench_model.run)
    benches = p.add_subparsers(dest="bench", metavar="[BENCH]", required=False)
    for name, (module, help_line) in BENCHES.items():
        if argv is None or name in argv or name == "model":  # the model bench's module is loaded anyway
            importlib.import_module(module).add_parser(benches)
        else:
            benches.add_parser(name, help=help_line)
