"""Where the tests' own files are, for tests in any folder: the tests' root (the helpers, the
data folder) and the repository's."""

from pathlib import Path

TESTS = Path(__file__).resolve().parent
DATA = TESTS / "data"
REPO = TESTS.parent
