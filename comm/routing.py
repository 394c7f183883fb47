"""Routing arithmetic for the MoE dispatcher, with no collectives: which ep rank holds an
expert, which island a rank sits in and which rank relays for it, the order rows travel in,
the capacity drop rule, and the fewest rows any dispatcher could move. Testable without
processes; comm/dispatch.py does the moving.
"""

from __future__ import annotations

import math

import torch

from atoll.comm.experts import expert_split, expert_starts  # noqa: F401  (the routing arithmetic's API)
from atoll.errors import ConfigError


def expert_owner(ids: torch.Tensor, split: list[int]) -> torch.Tensor:
    """ep rank that holds each expert id (any shape; ids must be in range)."""
    ends = torch.tensor(split, device=ids.device).cumsum(0)
    return torch.searchsorted(ends, ids.contiguous(), right=True)


def check_islands(islands, ep: int) -> list[list[int]]:
    """islands: lists of ep-group ranks that share a fast link; they must partition range(ep)."""
    islands = [sorted(int(r) for r in isl) for isl in islands]
    flat = sorted(r for isl in islands for r in isl)
    if any(not isl for isl in islands) or flat != list(range(ep)):
        raise ConfigError(f"islands {islands} do not split the {ep} ep ranks 0..{ep - 1} "
                          "into non-empty disjoint sets")
    return islands


def island_index(islands: list[list[int]], ep: int) -> list[int]:
    """ep rank -> index of its island."""
    out = [0] * ep
    for i, isl in enumerate(islands):
        for r in isl:
            out[r] = i
    return out


def relay_rank(src: int, island: list[int], islands: list[list[int]], island_of: list[int]) -> int:
    """The rank of `island` that receives src's rows for it: the one at the same position in its
    island as src holds in its own (modulo the size), so the relays' load is spread evenly."""
    pos = islands[island_of[src]].index(src)
    return island[pos % len(island)]


def sort_by_key(keys: torch.Tensor, num_keys: int) -> tuple[torch.Tensor, torch.Tensor]:
    """keys: [n] in [-1, num_keys), -1 = skip. Returns (order, counts [num_keys]) where
    order lists the kept positions grouped by key ascending, original order inside a key
    (stable), so rows for one destination stay in token order."""
    valid = keys >= 0
    counts = torch.bincount(keys[valid], minlength=num_keys)
    if counts.numel() > num_keys:
        raise ValueError(f"expert id {int(keys.max())} out of range for {num_keys} experts")
    order = torch.argsort(torch.where(valid, keys, num_keys), stable=True)
    return order[: int(valid.sum())], counts


def expert_major(counts: torch.Tensor) -> torch.Tensor | None:
    """counts: [sources, local experts] rows received from each source for each local expert,
    which arrive source-major. Returns the index that reorders them expert-major (rows =
    received[index]), or None when they already are (one local expert or one source)."""
    sources, local = counts.shape
    if local <= 1 or sources <= 1:
        return None
    flat = counts.reshape(-1)
    src_start = (flat.cumsum(0) - flat).view(sources, local).t().reshape(-1)
    sizes = counts.t().reshape(-1)  # blocks in expert-major order
    out_start = sizes.cumsum(0) - sizes
    n = int(sizes.sum())
    return torch.arange(n, device=counts.device) - torch.repeat_interleave(out_start - src_start, sizes)


def capacity_of(capacity_factor: float, total_pairs: int, num_experts: int) -> int:
    """Rows each expert keeps: ceil(capacity_factor * all (token, expert) pairs of the step,
    over every ep rank / num_experts)."""
    return math.ceil(round(capacity_factor * total_pairs / num_experts, 6))  # 1.1*100/10 is 11


def capacity_keep(ids: torch.Tensor, counts: torch.Tensor, src: int, capacity: int) -> torch.Tensor:
    """The drop rule. Each expert keeps the first `capacity` of the (token, expert) pairs routed
    to it, ordered by (source ep rank, token index, top-k slot); later pairs are dropped and
    contribute 0 to combine (weights are not renormalised).

    ids: [tokens, k] this rank's expert ids (-1 = none); counts: [ep, num_experts] pairs per
    (source rank, expert) before dropping. Returns keep: [tokens, k] bool."""
    before = counts.cumsum(0)[src] - counts[src]  # [E] pairs of lower ranks ahead of mine
    allowed = (capacity - before).clamp(min=0)
    flat = ids.reshape(-1)
    order, mine = sort_by_key(flat, counts.shape[1])
    starts = mine.cumsum(0) - mine
    rank_in_expert = torch.empty_like(flat)
    rank_in_expert[order] = torch.arange(order.numel(), device=ids.device) - starts[flat[order]]
    keep = torch.zeros_like(flat, dtype=torch.bool)
    keep[order] = rank_in_expert[order] < allowed[flat[order]]
    return keep.view(ids.shape)


def min_rows(ids: torch.Tensor, split: list[int], island_of: list[int], me: int) -> dict[str, int]:
    """The fewest rows any dispatcher must send from rank `me` for one dispatch (combine needs
    as many back): each token must reach every other rank that holds one of its experts. Across
    islands it need cross only once per remote island it touches (then fan out there), so
    cross = (token, remote island) pairs and intra = the remaining (token, rank) hops inside
    islands. ids: [tokens, k], -1 = none."""
    ep = len(split)
    valid = ids >= 0
    owner = expert_owner(ids.clamp(min=0), split)
    hit = torch.zeros(ids.shape[0], ep + 1, dtype=torch.bool, device=ids.device)
    hit.scatter_(1, torch.where(valid, owner, ep), True)
    hit = hit[:, :ep].float()  # [tokens, ep] ranks each token must reach
    member = torch.zeros(ep, max(island_of) + 1, device=ids.device)
    member[torch.arange(ep, device=ids.device), torch.tensor(island_of, device=ids.device)] = 1.0
    per_island = hit @ member  # [tokens, islands] distinct ranks hit on each island
    mine = island_of[me]
    remote = torch.ones(per_island.shape[1], dtype=torch.bool, device=ids.device)
    remote[mine] = False
    cross = int((per_island[:, remote] > 0).sum())
    intra = int(per_island[:, mine].sum() - hit[:, me].sum()) \
        + int((per_island[:, remote] - 1).clamp(min=0).sum())
    return {"intra": intra, "cross": cross}
