"""One safetensors file's header, read without torch and checked against the file's length:
a file cut short (inside its header, or before a tensor's last byte) is one CheckpointError
naming the file and the tensor it cuts. The format: an 8-byte little-endian header length,
the JSON header {name: {"dtype", "shape", "data_offsets": [begin, end]}}, then the data."""

from __future__ import annotations

import json
from pathlib import Path

from atoll.errors import CheckpointError

MAX_HEADER = 100_000_000  # safetensors' own bound on a header's length


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
