"""The `atoll` command line. Each subcommand lives in its own module with
`add_parser(subparsers)`; user errors (AtollError) print one line and exit 2."""

from __future__ import annotations

import argparse
import importlib
import re
import sys

from atoll.errors import AtollError

# subcommand -> module; modules import heavy packages lazily inside run()
COMMANDS = {
    "generate": "atoll.cli.generate",
    "demo": "atoll.cli.demo",
    "convert": "atoll.cli.convert",
    "plan": "atoll.cli.plan",
    "simulate": "atoll.cli.simulate",
    "calibrate": "atoll.cli.calibrate",
    "topo": "atoll.cli.topo",
    "bench": "atoll.cli.bench",
    "serve": "atoll.cli.serve",
    "eval": "atoll.cli.eval",
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


def build_parser() -> argparse.ArgumentParser:
    """Building the parser imports no torch: `atoll --help` answers at once."""
    parser = Parser(prog="atoll", description="Model-parallel LLM inference.")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=Parser)
    for module in COMMANDS.values():
        try:
            mod = importlib.import_module(module)
        except ModuleNotFoundError as e:
            if e.name == module:  # subcommand not written yet
                continue
            raise
        mod.add_parser(sub)
    return parser


class Terminated(KeyboardInterrupt):
    """SIGTERM, handled like Ctrl-C: every request not finished is written as failed."""

    def __str__(self):
        return "terminated (SIGTERM)"


def _on_sigterm(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> None:
    import signal
    import threading

    parser = build_parser()
    args = parser.parse_args(argv)
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
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(141)
    from atoll.launch.leave import leave_job

    leave_job(rc)  # a torchrun/mpirun rank: at once, before gloo's threads meet the shutdown
    sys.exit(rc)
