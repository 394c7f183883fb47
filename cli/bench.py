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

# benchmark name -> module (imports heavy packages lazily inside its run())
BENCHES = {
    "model": "atoll.bench.model",
    "dispatch": "atoll.bench.dispatch",
    "exchange": "atoll.bench.exchange",
    "kernels": "atoll.bench.kernels",
    "prefix": "atoll.bench.prefix",
    "disagg": "atoll.bench.disagg",
    "serve": "atoll.bench.serve",
    "startup": "atoll.bench.startup",
    "spec": "atoll.bench.spec",
}


def add_parser(sub) -> None:
    p = sub.add_parser(
        "bench", help="benchmarks (atoll bench [model options] | atoll bench dispatch ...)",
        description="Benchmarks that time atoll against a baseline in the same run and print "
                    "the ratio. With no name: the model bench (atoll vs transformers, decode vs "
                    "bandwidth floor). Named: " + ", ".join(BENCHES) + ".",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    bench_model.add_arguments(p)
    p.set_defaults(run=bench_model.run)
    benches = p.add_subparsers(dest="bench", metavar="[BENCH]", required=False)
    for module in BENCHES.values():
        importlib.import_module(module).add_parser(benches)
