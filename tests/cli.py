"""Running the `atoll` CLI inside a test."""

import pytest

from atoll.launch.cli import main


def run_cli(capsys, *argv):
    """(exit code, stdout, stderr) of `atoll ARGV...`."""
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    out = capsys.readouterr()
    return e.value.code, out.out, out.err
