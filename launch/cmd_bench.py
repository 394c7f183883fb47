"""atoll bench: benchmarks that print ratios measured side by side in one run.

Each benchmark is a module in BENCHES with `add_parser(subparsers)` that adds its own parser and
`set_defaults(run=...)`; `atoll bench NAME --help` lists its options. Plain `atoll bench` (no
name) is kept for the model throughput bench: give the `bench` parser its options and replace
`run` below when that exists.
"""

from __future__ import annotations

import argparse
import importlib

from atoll.errors import InputError

# benchmark name -> module (imports heavy packages lazily inside its run())
BENCHES = {
    "dispatch": "atoll.launch.bench_dispatch",
}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench", help="benchmarks (atoll bench dispatch ...)",
        description="Benchmarks that time atoll against a baseline in the same run and print "
                    "the ratio. Name one: " + ", ".join(BENCHES) + ".",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    p.set_defaults(run=run)
    benches = p.add_subparsers(dest="bench", metavar="BENCH")
    for module in BENCHES.values():
        importlib.import_module(module).add_parser(benches)


def run(args) -> int:
    """`atoll bench` with no benchmark named."""
    raise InputError("name a benchmark: atoll bench {" + ",".join(BENCHES) + "} ...")
