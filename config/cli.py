"""EngineConfig as command-line flags: one --flag per field, its default the environment's
value or the field's own."""

from __future__ import annotations

import argparse
from dataclasses import fields

from atoll.config.engine import EngineConfig


def add_cli_options(parser, defaults: EngineConfig | None = None) -> None:
    """One --flag per EngineConfig field, with its default and help; `defaults` (from
    config.resolve(), so ATOLL_* variables count) in place of the fields' own."""
    for f in fields(EngineConfig):
        if f.metadata.get("cli") is False:
            continue
        default = getattr(defaults, f.name) if defaults is not None else f.default
        flag = "--" + f.name.replace("_", "-")
        if str(f.type) == "bool":  # a switch: --flag sets it, --no-flag clears it
            parser.add_argument(flag, dest=f.name, action=argparse.BooleanOptionalAction, default=default,
                                help=f.metadata["help"])
            continue
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        parser.add_argument(flag, dest=f.name, type=kind, default=default, choices=f.metadata["choices"],
                            metavar=None if f.metadata["choices"] else f.name.split("_")[-1].upper(),
                            help=f.metadata["help"])


def add_model_options(p, defaults: EngineConfig | None = None) -> None:
    """The layout flags (--layout or vLLM's -tp/-pp/-dp/-ep, and -cp) and every engine option: what
    `atoll generate`, `serve`, `eval` and the serving benchmark take alike."""
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=None, metavar="N")
    p.add_argument("--pipeline-parallel-size", "-pp", type=int, default=None, metavar="N")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=None, metavar="N",
                   help="attention data parallel replicas inside a stage (MoE models)")
    p.add_argument("--expert-parallel-size", "-ep", type=int, default=None, metavar="N")
    p.add_argument("--context-parallel-size", "-cp", type=int, default=None, metavar="N",
                   help="context parallel ranks: each computes a share of a prompt and keeps a share of its KV cache")
    p.add_argument("--layout", default=None, help="e.g. TP2PP2, DP2EP2, TP2CP2 (instead of -tp/-pp/-dp/-ep/-cp); auto: plan "
                                                  "on this machine's topology for these requests")
    add_cli_options(p, defaults=defaults)


def from_args(args) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig) if hasattr(args, f.name)})
