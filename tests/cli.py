"""Running the `atoll` CLI inside a test."""

import pytest

from atoll.cli.main import main


def run_cli(capsys, *argv):
    """(exit code, stdout, stderr) of `atoll ARGV...` (each argument as str), that call's output only."""
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    out = capsys.readouterr()
    return e.value.code, out.out, out.err
