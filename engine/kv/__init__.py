"""The KV cache's home: the block pool (prefix names, eviction, events), the windowed pool of
hybrid sliding-window models, and the cache's sizing (bytes per block, blocks for a budget),
which the planner calls too. No torch, no ranks (the import contract checks it)."""
