"""What a command imports: `atoll --help` imports no subcommand's module, `atoll plan` and
`atoll simulate` (their help and a run) no torch, and the table of subcommands names each
module's own help line."""

import argparse
import subprocess
import sys

HELP_IMPORTS_NO_COMMAND = """
import sys
from atoll.cli.main import main
try:
    main(["--help"])
except SystemExit as e:
    assert e.code == 0
heavy = sorted(m for m in ("torch", "transformers", "triton", "ray", "numpy") if m in sys.modules)
commands = sorted(m for m in sys.modules if m.startswith("atoll.cli.") and m != "atoll.cli.main")
assert not heavy and not commands, (heavy, commands)
try:
    main(["bench", "spec", "--help"])
except SystemExit as e:
    assert e.code == 0
others = sorted(m for m in ("atoll.bench.kernels", "atoll.bench.dispatch", "atoll.bench.serve") if m in sys.modules)
assert not others, others
"""

NO_TORCH = """
import sys
from atoll.cli.main import main
for argv in (["plan", "--help"], ["simulate", "--help"],
             ["plan", "--model", "Llama-3.1-8B", "--topology", "dgx-h200", "--top", "1", "--no-progress"],
             ["simulate", "--model", "Llama-3.1-8B", "--topology", "dgx-h200", "-tp", "8", "--num-prompts", "8",
              "--no-progress"]):
    try:
        main(argv)
    except SystemExit as e:
        assert e.code == 0, argv
heavy = sorted(m for m in ("torch", "transformers", "triton", "ray") if m in sys.modules)
assert not heavy, heavy
"""


def test_help_imports_no_command():
    r = subprocess.run([sys.executable, "-c", HELP_IMPORTS_NO_COMMAND], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_plan_and_simulate_import_no_torch():
    r = subprocess.run([sys.executable, "-c", NO_TORCH], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


def test_help_lines_are_the_modules_own():
    """`atoll --help` and `atoll bench --help` list COMMANDS' and BENCHES' lines without importing
    the modules: each line is the help that module's own parser gives."""
    from atoll.cli.bench import BENCHES
    from atoll.cli.main import COMMANDS, build_parser

    def listed(parser):
        action = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        return {a.dest: a.help for a in action._choices_actions}, action.choices

    top, parsers = listed(build_parser())
    assert top == {name: line for name, (_, line) in COMMANDS.items()}
    assert listed(parsers["bench"])[0] == {name: line for name, (_, line) in BENCHES.items()}


def test_lazy_package_names_still_import():
    code = ("from atoll import LLM, SamplingParams, Layout; from atoll.engine import RequestOutput; "
            "from atoll.kernels import fused_moe, rms_norm, KernelError; import atoll.kernels as k; "
            "assert callable(k.rotary_) and LLM.__name__ == 'LLM'")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
