"""Requests from a JSONL file, checked one line at a time, and results written as they finish.

A line is a JSON object: `id` (optional; default "line-N"), exactly one of `prompt` (text)
and `prompt_token_ids` (a list of token ids), and any of the sampling fields below, which
override the command line's values for that request. A line that cannot be served becomes
an output line `{"id", "line", "error"}` and the other lines still run.

Output: one JSON line per request, carrying its `id` and its input line number `line`.
Lines are written (and flushed) as requests finish, so a crash keeps what was done; at the
end, once every request has its line, a regular output file is rewritten in input order
through a temporary file and an atomic rename. After a crash the file holds what finished,
in finishing order; stdout (and a pipe or a device) always gets finishing order.
"""

from __future__ import annotations

import json
import os
import stat
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from atoll.errors import InputError

SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop", "ignore_eos", "n", "logprobs",
                   "prompt_logprobs", "presence_penalty", "frequency_penalty", "repetition_penalty", "logit_bias",
                   "min_tokens", "stop_token_ids", "bad_words", "structured_outputs")
FIELDS = ("id", "prompt", "prompt_token_ids", *SAMPLING_FIELDS)


@dataclass
class Line:
    """One request as read: its input line number (None for --prompt), id, the prompt part
    ({"prompt": ...} or {"prompt_token_ids": ...}), its sampling fields, or why it is invalid."""

    line: int | None
    id: object
    prompt: dict = field(default_factory=dict)
    sampling: dict = field(default_factory=dict)
    error: str | None = None


def read_prompts(path: str | Path) -> list[Line]:
    """Every non-blank line of a JSONL file, each parsed on its own. The file itself (missing,
    a directory, unreadable, not UTF-8, empty) is an InputError."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"--prompts {p} does not exist")
    if p.is_dir():
        raise InputError(f"--prompts {p} is a directory; give a JSONL file, one request per line")
    try:
        data = p.read_bytes()
    except OSError as e:
        raise InputError(f"cannot read --prompts {p}: {e.strerror}") from None
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as e:
        line = data[: e.start].count(b"\n") + 1
        raise InputError(f"--prompts {p} is not UTF-8 text: byte 0x{data[e.start]:02x} on line {line}") from None
    lines = []
    # split on "\n" only: str.splitlines would also split inside JSON strings at U+2028 and others
    for n, raw in enumerate(text.removeprefix("\ufeff").split("\n"), start=1):
        if raw.strip():
            lines.append(parse_line(raw, n))
    if not lines:
        raise InputError(f"--prompts {p} is empty: give one JSON request per line")
    return lines


def parse_line(raw: str, n: int) -> Line:
    """One JSONL line; what is wrong with it goes to Line.error, prefixed with its number."""
    ln = Line(n, f"line-{n}")
    try:
        obj = json.loads(raw)
    except RecursionError:
        ln.error = f"line {n}: JSON nested too deeply"
        return ln
    except ValueError as e:
        ln.error = f"line {n}: not valid JSON: {e}"
        return ln
    if not isinstance(obj, dict):
        ln.error = (f"line {n}: expected a JSON object such as {{\"id\": 1, \"prompt\": \"...\"}}, "
                    f"got {_json_kind(obj)}")
        return ln
    rid = obj.get("id", ln.id)
    if isinstance(rid, bool) or not isinstance(rid, (str, int)):
        ln.error = f"line {n}: id={_short(rid)} must be a string or a whole number"
        return ln
    ln.id = rid
    unknown = [k for k in obj if k not in FIELDS]
    if unknown:
        ln.error = f"line {n}: unknown field {unknown[0]!r}; a request takes {', '.join(FIELDS)}"
        return ln
    ln.prompt = {k: obj[k] for k in ("prompt", "prompt_token_ids") if k in obj}
    if len(ln.prompt) != 1:
        ln.error = (f"line {n}: give 'prompt' (text) or 'prompt_token_ids' (token ids), not both"
                    if ln.prompt else f"line {n}: a request needs 'prompt' (text) or 'prompt_token_ids' (token ids)")
        return ln
    ln.sampling = {k: obj[k] for k in SAMPLING_FIELDS if obj.get(k) is not None}  # null: the default
    return ln


def _json_kind(obj) -> str:
    kinds = {bool: "true/false", int: "a number", float: "a number", str: "a string", list: "a list"}
    return kinds.get(type(obj), "null" if obj is None else type(obj).__name__)


def _short(value) -> str:
    text = repr(value)  # repr escapes lone surrogates: the message stays writable
    return text if len(text) <= 40 else text[:37] + "..."


def check_output(output: str | Path, prompts: str | Path | None = None) -> None:
    """InputError unless `output` can be written as a file and is not the prompts file
    (whatever path spells either). Changes nothing on disk."""
    p = Path(output)
    if p.is_dir():
        raise InputError(f"--output {p} is a directory; give a file path such as {p / 'out.jsonl'}")
    parent = p.parent
    if not parent.exists():
        raise InputError(f"--output {p}: the directory {parent} does not exist")
    if not parent.is_dir():
        raise InputError(f"--output {p}: {parent} is not a directory")
    if prompts is not None and p.exists() and Path(prompts).exists() and os.path.samefile(p, prompts):
        raise InputError(f"--output {p} is the prompts file {prompts}: writing it would destroy the input; "
                         "give another path")
    writable = os.access(p, os.W_OK) if p.exists() else os.access(parent, os.W_OK | os.X_OK)
    if not writable:
        raise InputError(f"--output {p} is not writable (permission denied)")


def _dumps(row: dict, encoding: str) -> str:
    text = json.dumps(row, ensure_ascii=False)
    try:
        text.encode(encoding)
    except (UnicodeEncodeError, LookupError):  # e.g. a lone surrogate in an id: escape it
        text = json.dumps(row)
    return text + "\n"


class ResultWriter:
    """One JSON line per request index, each written and flushed once, as it comes (from a
    reporting thread or the main one). close() puts a regular file in index (input) order."""

    def __init__(self, path: str | Path | None, *, enabled: bool = True):
        self.path = None if path is None else Path(path)
        self.enabled = enabled
        self.rows: dict[int, str] = {}
        self._lock = threading.Lock()
        self._closed = False
        self._file = None
        self._identity = None  # (device, inode) of a regular output file, to reorder at close
        self.failure: str | None = None  # why writing stopped, if it did
        if not enabled:
            return
        if self.path is None:
            self._file = sys.stdout
            return
        try:
            self._file = open(self.path, "w", encoding="utf-8")
            st = os.fstat(self._file.fileno())
        except OSError as e:
            raise InputError(f"cannot write --output {self.path}: {e.strerror}") from None
        self._identity = (st.st_dev, st.st_ino) if stat.S_ISREG(st.st_mode) else None

    def write(self, index: int, row: dict) -> None:
        with self._lock:
            if self._closed or index in self.rows:
                return
            text = _dumps(row, getattr(self._file, "encoding", None) or "utf-8")
            self.rows[index] = text
            if self._file is None:
                return
            try:
                self._file.write(text)
                self._file.flush()
            except BrokenPipeError:  # stdout's reader went away (`| head`): keep going quietly
                self._file = None
            except OSError as e:  # a full disk, say: the run goes on, the CLI reports it at the end
                self.failure = f"cannot write --output {self.path or 'stdout'}: {e.strerror}"
                self._file, self._identity = None, None

    def written(self, index: int) -> bool:
        with self._lock:
            return index in self.rows

    def close(self) -> None:
        """Stop writing; a regular output file is then rewritten in input order (atomically:
        readers see the finishing-order file or the ordered one, never a partial file)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._file is None or self._file is sys.stdout:
                return
            try:
                self._file.close()
            except OSError as e:
                self.failure = f"cannot write --output {self.path}: {e.strerror}"
                return
        if self._identity is None:
            return  # a pipe or a device: it keeps finishing order
        target = os.path.realpath(self.path)
        size = sum(len(text.encode("utf-8")) for text in self.rows.values())
        try:
            st = os.stat(target)
        except OSError:
            return
        if (st.st_dev, st.st_ino) != self._identity or st.st_size != size:
            return  # not the file this run wrote, or written by someone else too: leave it
        tmp = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.{os.getpid()}.tmp")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                f.writelines(self.rows[i] for i in sorted(self.rows))
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
            os.replace(tmp, target)
        except OSError:  # e.g. the directory is not writable: the file stays in finishing order
            try:
                os.unlink(tmp)
            except OSError:
                pass
