import sys
from pathlib import Path

# `python -m atoll` run in the repository's own folder puts that folder first on the path; it is
# the package atoll, not a folder of top-level modules (its kernels/ would shadow the `kernels`
# package that transformers imports), so it comes off before anything else is imported.
_HERE = Path(__file__).resolve().parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _HERE]

from atoll.cli.main import main  # noqa: E402

if __name__ == "__main__":
    main()
