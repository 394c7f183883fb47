"""The KV cache's lower tiers: blocks the device pool lets go of, kept by name in host memory,
on a local disk and in a shared store (a directory or Redis), so a prefix evicted from the
device, computed before a restart, or computed by another replica is read back instead of
computed again. Bytes only: the rank loop hands in a block's K/V as stored and copies it back.
record.py is the format, index.py the eviction order, chain.py the whole. No torch (the import
contract checks it)."""
