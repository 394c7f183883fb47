"""A tree of drafts as the target verifies it in one forward: its shape, its attention over the
paged cache, and the compaction of the path kept.

Node 0 is the sequence's pending token (at position `start`, the first uncached one); node i
(i >= 1) drafts tokens[i] after its parent parents[i] < i. In the verify forward node i is one
decode row: its keys and values are written at cache slot start + i (the sequence's blocks
must cover start + len(nodes)), its rotary position is start + depth(i), and it reads the
sequence's context (slots < start) and the slots of its ancestors and itself, no sibling or
cousin. Each row's logits are the target's distribution after that node's path
(engine.sample.tree_rule walks them).

After the walk the path kept, nodes n_1 < n_2 < ... (depth j at n_j >= j), has its keys and
values moved from slot start + n_j to start + j, so the sequence's positions stay contiguous;
every other node's slots are left to be overwritten.
"""

from __future__ import annotations

import torch

from atoll.layers.attention import AttentionMetadata
from atoll.layers.kv_quant import QuantizedKV


def depths(parents: list[int]) -> list[int]:
    """parents (parents[0] = -1) -> each node's depth, the root's 0."""
    out = [0] * len(parents)
    for node in range(1, len(parents)):
        if not 0 <= parents[node] < node:
            raise ValueError(f"tree parents[{node}]={parents[node]} must name an earlier node")
        out[node] = out[parents[node]] + 1
    return out


def tree_mask(parents: list[int]) -> torch.Tensor:
    """[nodes, nodes] bool: row i reads column j when j is i or one of its ancestors."""
    n = len(parents)
    mask = torch.eye(n, dtype=torch.bool)
    for node in range(1, n):
        mask[node] |= mask[parents[node]]
    return mask


def tree_meta(table: list[int], start: int, parents: list[int], block_size: int, *,
              device="cpu") -> AttentionMetadata:
    """The verify forward's metadata for one sequence's tree: one decode row per node, written
    at slot start + i, at position start + depth(i), reading its context and its ancestors."""
    return rows_meta([(table, start, parents, range(len(parents)))], block_size, device=device)


def rows_meta(trees, block_size: int, *, device="cpu") -> AttentionMetadata:
    """trees: [(block table, start, parents, the nodes that get a row)] -> one decode row per
    node listed, tree by tree: node i written at slot start + i, at position start + depth(i),
    reading the slots before `start` and those of its ancestors and itself."""
    tables, starts, positions, spans = [], [], [], []
    for table, start, parents, nodes in trees:
        n = len(parents)
        if len(table) * block_size < start + n:
            raise ValueError(f"a tree of {n} nodes from position {start} needs {start + n} slots; "
                             f"the table holds {len(table) * block_size}")
        depth = depths(parents)
        for i in nodes:
            tables.append(table)
            starts.append(start + i)
            positions.append(start + depth[i])
        spans.append((start, tree_mask(parents), nodes))
    meta = AttentionMetadata.build(tables, starts, [1] * len(starts), block_size, device=device)
    meta.positions = torch.tensor(positions, dtype=torch.long, device=device)
    keys = -(-max(start + len(mask) for start, mask, _ in spans) // block_size) * block_size
    visible = torch.zeros(len(starts), keys, dtype=torch.bool)
    row = 0
    for start, mask, nodes in spans:
        for i in nodes:
            visible[row, :start] = True
            visible[row, start:start + len(mask)] = mask[i]
            row += 1
    meta.visible = visible.to(device)
    return meta


def verify_meta(chunks, block_size: int, *, device="cpu") -> AttentionMetadata:
    """A verify step's metadata, every chunk a decoding sequence's pending token and its draft:
    a tree chunk's rows read their ancestors (rows_meta), a chain's its earlier positions."""
    trees = []
    for c in chunks:
        parents = c.parents if c.parents is not None else list(range(-1, c.count - 1))
        trees.append((c.seq.blocks, c.start, parents, range(c.count)))
    return rows_meta(trees, block_size, device=device)


def kept_path(parents: list[int], tokens: list[int], taken: list[int]) -> list[int]:
    """The drafted nodes a verify kept, from the tokens it took (tokens: [pending] + draft):
    from the root, the child carrying each taken token but the last, while one does."""
    path, node = [], 0
    for token in taken[:-1]:
        node = next((c for c in range(node + 1, len(parents)) if parents[c] == node and tokens[c] == token), None)
        if node is None:
            break
        path.append(node)
    return path


def path_slots(start: int, path: list[int]) -> list[tuple[int, int]]:
    """The moves that compact a kept path: (from slot, to slot) for node n_j at depth j; a node
    already in place does not move."""
    return [(start + node, start + j) for j, node in enumerate(path, 1) if node != j]


def compact(cache, table: list[int], start: int, path: list[int], block_size: int) -> None:
    """Moves the kept path's keys and values into contiguous slots (path_slots) in every layer
    of `cache` (a KVCache: per-layer k and v, v None for a keys-only layer)."""
    moves = path_slots(start, path)
    if not moves:
        return
    src = torch.tensor([s for s, _ in moves])
    dst = torch.tensor([d for _, d in moves])
    blocks = torch.tensor(table)
    at = lambda slots: (blocks[slots // block_size], slots % block_size)  # noqa: E731 (block, offset)
    (sb, so), (db, do) = at(src), at(dst)
    for layer in (*cache.k, *cache.v):
        if layer is None:
            continue
        if isinstance(layer, QuantizedKV):
            raise NotImplementedError("tree drafts over a quantized KV cache are not built yet")
        dev = layer.device  # every source read before any slot is written
        layer[db.to(dev), do.to(dev)] = layer[sb.to(dev), so.to(dev)]
