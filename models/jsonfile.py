"""Reading a checkpoint's JSON files, each error one line naming the file."""

from __future__ import annotations

import json
from pathlib import Path

from atoll.errors import CheckpointError


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def read_json_object(path: Path, error=CheckpointError) -> dict:
    """A checkpoint's JSON file that must hold an object; `error` naming it if not."""
    try:
        d = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path} is not valid JSON: {first_line(e)}") from None
    except OSError as e:
        raise error(f"cannot read {path}: {e.strerror}") from None
    if not isinstance(d, dict):
        raise error(f"{path} does not hold a JSON object")
    return d
