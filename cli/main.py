"""The `atoll` command line. Each subcommand lives in its own module with
`add_parser(subparsers)`, imported only when that subcommand runs; user errors (AtollError)
print one line and exit 2."""

from __future__ import annotations

import argparse
import importlib
import os
import re
import signal
import sys
import threading

from atoll.errors import AtollError
from atoll.launch.leave import leave_job

# subcommand -> (module, its one-line help). `atoll --help` lists these without importing any
# module; `atoll CMD ...` imports CMD's alone (tests/cli check each line is its module's own help)
COMMANDS = {
    "generate": ("atoll.cli.generate", "generate text for prompts at a parallel layout"),
    "demo": ("atoll.cli.demo", "run the bundled SmolLM2-135M model across local ranks"),
    "convert": ("atoll.cli.convert", "convert a GGUF file to a Hugging Face checkpoint directory"),
    "plan": ("atoll.cli.plan", "recommend a parallel layout for a model on a cluster"),
    "simulate": ("atoll.cli.simulate", "simulate a deployment under a load: bench serve's figures, predicted"),
    "calibrate": ("atoll.cli.calibrate",
                  "measure this machine (GEMM, memory, per-layer overhead, collectives) into a topology YAML"),
    "topo": ("atoll.cli.topo", "show a cluster topology and its NVLink islands"),
    "bench": ("atoll.cli.bench", "benchmarks (atoll bench [model options] | atoll bench dispatch ...)"),
    "serve": ("atoll.cli.serve", "serve a model over OpenAI-compatible HTTP (completions, chat)"),
    "eval": ("atoll.cli.eval", "model quality through atoll's ranks: perplexity, greedy agreement"),
    "spec": ("atoll.cli.spec", "speculative decoding's tools: train-eagle3 trains an EAGLE-3 head for a checkpoint"),
    "calibrate-kv": ("atoll.cli.calibrate_kv", "fit fp8 KV cache scales from a text and write them beside the checkpoint"),
}


# argparse's wording -> what would be valid
_PLAIN = ((re.compile(r"invalid int value: (.*)"), r"\1 is not a whole number"),
          (re.compile(r"invalid float value: (.*)"), r"\1 is not a number"))


class Parser(argparse.ArgumentParser):
    """An ArgumentParser whose errors are one line, `atoll: error: ...`, and exit code 2,
    like every other user error (no usage dump); the subcommands' parsers are this class too."""

    def error(self, message: str):
        for pattern, plain in _PLAIN:
            message = pattern.sub(plain, message)
        command = self.prog.removeprefix("atoll").strip()
        where = f"{command}: " if command else ""
        help_hint = f"atoll {command} --help" if command else "atoll --help"
        line = " ".join(f"{where}{message}".split())  # one line, whatever argparse wrapped
        self.exit(2, f"atoll: error: {line} (see `{help_hint}`)\n")


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `atoll` parser for `argv`: only the subcommand argv names is built from its module (so
    `atoll plan` loads no engine, and `atoll --help` no subcommand at all); the others are their
    one line from COMMANDS. With no argv, every subcommand is built (to parse any command line)."""
    parser = Parser(prog="atoll", description="Model-parallel LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=Parser)
    # the top parser's only option is --help, so the first word that is no option is the command
    command = None if argv is None else next((a for a in argv if not a.startswith("-")), None)
    for name, (module, help_line) in COMMANDS.items():
        if argv is not None and name != command:
            sub.add_parser(name, help=help_line)
            continue
        mod = importlib.import_module(module)
        if name == "bench":  # of the benchmarks too, only those named after `bench`
            mod.add_parser(sub, None if argv is None else argv[argv.index(name) + 1:])
        else:
            mod.add_parser(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C: every request not finished is written as failed."""

    def __str__(self):
        return "terminated (SIGTERM)"


def _on_sigterm(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        rc = args.run(args) or 0
    except AtollError as e:
        text = " ".join(line.strip() for line in str(e).splitlines() if line.strip())
        print(f"atoll: error: {text or type(e).__name__}", file=sys.stderr)
        rc = 2
    except KeyboardInterrupt as e:
        print(f"atoll: {e or 'interrupted'}", file=sys.stderr)
        rc = 143 if isinstance(e, Terminated) else 130
    except BrokenPipeError:  # `atoll plan ... | head`: the reader left; no traceback
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    leave_job(rc)  # a torchrun/mpirun rank: at once, before gloo's threads meet the shutdown
    sys.exit(rc)
