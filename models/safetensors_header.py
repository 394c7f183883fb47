"""One safetensors file's header, read without torch and checked against the file's length:
a file cut short (inside its header, or before a tensor's last byte) is one CheckpointError
naming the file and the tensor it cuts. The format: an 8-byte little-endian header length,
the JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]}}, then the data."""

from __future__ import annotations

import json
from pathlib import Path

from atoll.errors import CheckpointError

MAX_HEADER = 100_000_000  # safetensors' own bound on a header's length
INDEX = "model.safetensors.index.json"


def read_header(path: Path) -> dict[str, dict]:
    """name -> {"dtype", "shape", "data_offsets"} of the safetensors file at path, from its
    8-byte length and JSON header (no tensor is read)."""
    try:
        size = path.stat().st_size
        if size < 8:
            raise CheckpointError(f"{path} is truncated: {size} bytes, less than a safetensors header's "
                                  "8-byte length")
        with open(path, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            if n > MAX_HEADER:
                raise CheckpointError(f"cannot read {path}: corrupt safetensors header (its length field says "
                                      f"{n} bytes)")
            if n > size - 8:
                raise CheckpointError(f"{path} is truncated inside its header: the header is {n} bytes, the "
                                      f"file holds {size - 8} after its length")
            header = json.loads(fh.read(n))
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror}") from None
    except ValueError as e:  # not JSON, or not UTF-8
        raise CheckpointError(f"cannot read {path}: corrupt safetensors header ({e})") from None
    if not isinstance(header, dict):
        raise CheckpointError(f"cannot read {path}: corrupt safetensors header (not a JSON object)")
    tensors = {k: v for k, v in header.items() if k != "__metadata__"}
    data = size - 8 - n
    ends = {k: _end(v) for k, v in tensors.items()}
    cut = sorted((end, k) for k, end in ends.items() if end is not None and end > data)
    if cut:
        end, name = cut[0]
        raise CheckpointError(f"{path} is truncated: tensor {name} ends at byte {8 + n + end}, the file has "
                              f"{size} bytes")
    return tensors  # anything else malformed is safetensors' to say when the file is opened


def _end(info) -> int | None:
    offsets = info.get("data_offsets") if isinstance(info, dict) else None
    ok = isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)
    return offsets[1] if ok else None


def slice_stops(index, ndim: int) -> list[int | None]:
    """How far `src[index]` reads each dimension: a slice's stop, None where the index does
    not bound it (`:`, a dimension left out, or an index too unusual to read)."""
    index = index if isinstance(index, tuple) else (index,)
    if len(index) > ndim or any(i is Ellipsis or i is None for i in index):
        return [None] * ndim
    stops = [None] * ndim
    for d, i in enumerate(index):
        if isinstance(i, slice) and i.stop is not None and i.stop >= 0 and (i.step or 1) > 0:
            stops[d] = i.stop
    return stops


def tensor_names(directory: str | Path) -> set[str]:
    """The tensor names a checkpoint directory holds, from its index or its files' headers
    (the 8-byte length and the JSON header of each safetensors file: no tensor is read)."""
    d = Path(directory)
    index = d / INDEX
    try:
        if index.exists():
            return set(json.loads(index.read_text())["weight_map"])
        return {name for f in sorted(d.glob("*.safetensors")) for name in read_header(f)}
    except (OSError, ValueError, KeyError, TypeError, CheckpointError):
        return set()  # unreadable here: Checkpoint says why when the weights are loaded
