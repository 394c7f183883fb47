"""The `atoll` command line. Each subcommand lives in its own module with
`add_parser(subparsers)`; user errors (AtollError) print one line and exit 2."""

from __future__ import annotations

import argparse
import importlib
import sys

from atoll.errors import AtollError

# subcommand -> module; modules import heavy packages lazily inside run()
COMMANDS = {
    "generate": "atoll.launch.cmd_generate",
    "demo": "atoll.launch.cmd_demo",
    "convert": "atoll.launch.cmd_convert",
    "plan": "atoll.launch.cmd_plan",
    "topo": "atoll.launch.cmd_topo",
    "bench": "atoll.launch.cmd_bench",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="atoll", description="Model-parallel LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for module in COMMANDS.values():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:  # subcommand not written yet
                continue
            raise
        mod.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        rc = args.run(args)
    except AtollError as e:
        print(f"atoll: error: {e}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt:
        print("atoll: interrupted", file=sys.stderr)
        sys.exit(130)
    sys.exit(rc or 0)
