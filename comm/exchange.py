"""gather_combine: a fixed-shape MoE exchange for decode-sized batches.

    y = gather_combine(x, ids, weights, expert_fn, ep_group, split, replicated=False)

The Dispatcher's all_to_all needs its split sizes on the host (a `.tolist()` per step), so a
CUDA graph or a fullgraph torch.compile cannot hold it. Here every collective has a shape
known from x's alone: each ep rank runs its own experts on every row and the partial sums
are added over the group.

replicated=False: each ep rank holds its own rows, every rank the same number (the caller
pads). One all_gather of the rows packed with their ids and weights, this rank's experts on
the ep * rows gathered rows, one reduce_scatter back: each rank gets its own rows summed
over the ranks. replicated=True: the ranks already hold the same rows (TP-replicated
tokens): no gather, the experts on every row, one all_reduce.

It moves rows a top-k router does not send to most ranks, so it pays at few rows, where
the all_to_all's latency (a count exchange, a device sync, two uneven exchanges) dominates.
No `.item()`, `.tolist()` or data-dependent shape on this path.

gather_combine_steps is the same exchange as an overlapped step (comm/pending.py): it yields
while its all_gather and its reduce_scatter (or all_reduce) fly, so two-batch overlap runs the
other micro-batch's attention and experts meanwhile; gather_combine drives it to its end.

expert_fn(rows [n, hidden], local_ids [n, k] (-1 where the expert is not this rank's),
weights [n, k]) -> [n, hidden]: the weighted sum of this rank's experts' outputs per row,
0 for a row with none, in a tensor of its own (the all_reduce runs in place). Outputs are
summed over ranks in their dtype, as combine does.

Bytes. counters (a Counter, as Dispatcher.bytes) gets the bytes this rank sends per link
class ("intra" inside its island, "cross" across; island_of=None is one island), counted as
point to point: the all_gather sends this rank's packed rows to every peer, the
reduce_scatter each peer its rows of this rank's partial sums, and the all_reduce is a
reduce_scatter then an all_gather of row chunks (torch.tensor_split's sizes): to peer j
chunk_j rows of partial sums, then this rank's summed chunk. Host arithmetic on shapes;
not counted inside a compiled trace (a symbolic shape would be fixed by it), as Group does.
"""

from __future__ import annotations

from collections import Counter

import torch

from atoll.comm.group import Group
from atoll.comm.pending import ready
from atoll.errors import ConfigError


def gather_combine(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, expert_fn, group: Group,
                   split: list[int], *, replicated: bool, counters: Counter | None = None,
                   island_of: list[int] | None = None) -> torch.Tensor:
    # x: [rows, hidden]; ids, weights: [rows, k] global expert ids (-1: none) and their weights
    _check(x, ids, weights, group, split, replicated, counters, island_of)
    if replicated or group.size == 1:
        y = expert_fn(x, _local(ids, group.rank, split), weights)  # [rows, hidden] partial sums
        return group.all_reduce(y) if replicated else y
    every = group.all_gather(_pack(x, ids, weights), dim=0)  # [ep * rows, hidden + meta]
    x_all, ids_all, w_all = _unpack(every, x.shape[1], ids.shape[1])
    y = expert_fn(x_all, _local(ids_all, group.rank, split), w_all)  # [ep * rows, hidden]
    return group.reduce_scatter(y, dim=0)  # [rows, hidden]: my rows, summed over ranks


def gather_combine_steps(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, expert_fn, group: Group,
                         split: list[int], *, replicated: bool, counters: Counter | None = None,
                         island_of: list[int] | None = None, overlap: bool = False):
    """gather_combine as an overlapped step (a generator; comm/pending.py). Eager steps only: a
    compiled trace takes gather_combine (torch.compile does not trace a generator's return)."""
    _check(x, ids, weights, group, split, replicated, counters, island_of)
    if replicated or group.size == 1:
        y = expert_fn(x, _local(ids, group.rank, split), weights)  # [rows, hidden] partial sums
        if not replicated:
            return y
        summed = group.all_reduce(y, async_op=overlap)
        yield
        return ready(summed)
    every = group.all_gather(_pack(x, ids, weights), dim=0, async_op=overlap)  # [ep * rows, hidden + meta]
    yield
    x_all, ids_all, w_all = _unpack(ready(every), x.shape[1], ids.shape[1])
    y = expert_fn(x_all, _local(ids_all, group.rank, split), w_all)  # [ep * rows, hidden]
    mine = group.reduce_scatter(y, dim=0, async_op=overlap)  # [rows, hidden]: my rows, summed over ranks
    yield
    return ready(mine)


def _check(x, ids, weights, group: Group, split, replicated: bool, counters, island_of) -> None:
    """Check the shapes, and count the bytes this call sends (see the module's docstring)."""
    if len(split) != group.size:
        raise ConfigError(f"split {split} has {len(split)} entries for an ep group of {group.size}")
    if x.dim() != 2 or ids.dim() != 2 or ids.shape[0] != x.shape[0] or weights.shape != ids.shape:
        raise ConfigError(f"gather_combine wants x [rows, hidden] and ids, weights [rows, k]; got "
                          f"{tuple(x.shape)}, {tuple(ids.shape)}, {tuple(weights.shape)}")
    rows, hidden = x.shape
    if counters is not None and group.size > 1 and not torch.compiler.is_compiling():
        _count(counters, group, island_of, rows, hidden * x.element_size(), 8 * ids.shape[1], replicated)


def _local(ids: torch.Tensor, rank: int, split: list[int]) -> torch.Tensor:
    """ids [n, k] global -> local expert index on `rank`, -1 where another rank's (or none)."""
    start = sum(split[:rank])
    local = ids.long() - start
    return torch.where((ids >= 0) & (local < split[rank]), local, -1)


# ids ride as float32 values (exact below 2**24 experts) beside the float32 weights, both
# bit-viewed as x's dtype (8k bytes a row), so rows, ids and weights go in one all_gather
def _pack(x: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    meta = torch.cat([ids.float(), weights.float()], dim=1)  # [rows, 2k] float32
    return torch.cat([x, meta.view(x.dtype)], dim=1)


def _unpack(packed: torch.Tensor, hidden: int, k: int):
    x = packed[:, :hidden]
    meta = packed[:, hidden:].contiguous().view(torch.float32)  # [n, 2k]
    return x, meta[:, :k].long(), meta[:, k:]


def _count(counters: Counter, group: Group, island_of, rows: int, row_bytes: int, meta_bytes: int,
           replicated: bool) -> None:
    """row_bytes: one row of x; meta_bytes: the ids and weights packed with it."""
    ep, me = group.size, group.rank
    island_of = island_of or [0] * ep
    if len(island_of) != ep:
        raise ConfigError(f"island_of {island_of} has {len(island_of)} entries for an ep group of {ep}")
    chunks = [rows // ep + (r < rows % ep) for r in range(ep)]
    for j in range(ep):
        if j == me:
            continue
        if replicated:  # my partial of j's chunk, then my summed chunk
            n = (chunks[j] + chunks[me]) * row_bytes
        else:  # my packed rows out, then j's rows of my partial sums
            n = rows * (row_bytes + meta_bytes) + rows * row_bytes
        counters["intra" if island_of[j] == island_of[me] else "cross"] += n
