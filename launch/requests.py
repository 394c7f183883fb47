"""Reading requests from JSONL and writing results as JSONL."""

from __future__ import annotations

import json
from pathlib import Path

from atoll.errors import InputError


def read_jsonl(path: str | Path) -> tuple[list[dict], list[dict]]:
    """(requests, failures): a malformed line becomes a failure naming its line number,
    and the other lines still run."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"prompt file {p} does not exist")
    requests, failures = [], []
    for n, line in enumerate(p.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            obj = json.loads(line)
            if not isinstance(obj, dict) or not ("prompt" in obj or "prompt_token_ids" in obj):
                raise ValueError("expected an object with 'prompt' or 'prompt_token_ids'")
        except ValueError as e:
            failures.append({"id": f"line-{n}", "error": f"{p.name} line {n}: {e}"})
            continue
        obj.setdefault("id", f"line-{n}")
        requests.append(obj)
    if not requests and not failures:
        raise InputError(f"prompt file {p} is empty")
    if not requests:
        raise InputError(f"prompt file {p} has no valid request: {failures[0]['error']}")
    return requests, failures


def write_jsonl(rows: list[dict], path: str | Path | None) -> None:
    text = "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows)
    if path is None:
        print(text, end="")
    else:
        Path(path).write_text(text)
