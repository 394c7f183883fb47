"""The record a lower tier stores for one KV block: a fixed header, then the block's bytes.

A tier holds bytes that outlive the process that wrote them (a file on a local disk, a key in a
shared store), so a block read back is checked before its bytes reach a cache: whole (the
length the header promises), intact (a blake2b digest of the bytes), this deployment's (a
namespace digest of the model, dtypes and this rank's slice of the layout: another model's or
another rank's block of the same tokens has the same name) and the block asked for (its name in
the header, so a file renamed or a key overwritten is caught). Any failure is a `BadRecord`,
which the chain counts as a miss and deletes; it never becomes a wrong answer.

Header, little-endian, 64 bytes: magic b"AKV1", format version (u16), 2 bytes zero, namespace
digest (16), block name (16), payload length (u64), blake2b-16 of the payload.
"""

from __future__ import annotations

import hashlib
import json
import struct

MAGIC = b"AKV1"
VERSION = 1
HEADER = struct.Struct("<4sH2x16s16sQ16s")
REASONS = ("torn", "truncated", "checksum", "foreign", "key")


class BadRecord(Exception):
    """A stored record that must not be used; `reason` is one of REASONS."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


def namespace(**fields) -> bytes:
    """A 16-byte digest of what makes a block's bytes mean something: the model (id or config
    digest), dtype, kv dtype, layout and this rank's slice (tp rank/size, pp stage and layers,
    block size). Keyword order does not matter; values must be JSON-representable."""
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.blake2b(text.encode(), digest_size=16).digest()


def _digest(payload: bytes | memoryview) -> bytes:
    return hashlib.blake2b(payload, digest_size=16).digest()


def pack(namespace: bytes, key: bytes, payload: bytes) -> bytes:
    """The record of block `key` (16 bytes) of `namespace` holding `payload`."""
    if len(namespace) != 16 or len(key) != 16:
        raise ValueError(f"namespace and key are 16 bytes, got {len(namespace)} and {len(key)}")
    return HEADER.pack(MAGIC, VERSION, namespace, key, len(payload), _digest(payload)) + payload


def unpack(namespace: bytes, key: bytes, data: bytes) -> bytes:
    """The payload of `data`, a record of block `key` in `namespace`; BadRecord otherwise."""
    if len(data) < HEADER.size:
        raise BadRecord("truncated", f"{len(data)} bytes, shorter than the {HEADER.size}-byte header")
    magic, version, ns, name, length, digest = HEADER.unpack_from(data)
    if magic != MAGIC or version != VERSION:
        raise BadRecord("torn", f"header {magic!r} version {version}, not {MAGIC!r} version {VERSION}")
    if ns != namespace:
        raise BadRecord("foreign", f"namespace {ns.hex()}, not {namespace.hex()}")
    if name != key:
        raise BadRecord("key", f"block {name.hex()}, not {key.hex()}")
    if len(data) != HEADER.size + length:
        reason = "truncated" if len(data) < HEADER.size + length else "torn"
        raise BadRecord(reason, f"{len(data) - HEADER.size} payload bytes, header says {length}")
    payload = memoryview(data)[HEADER.size:]
    if _digest(payload) != digest:
        raise BadRecord("checksum", f"block {key.hex()}")
    return bytes(payload)
