"""The rank grid and ParallelContext.

Ranks are laid out as grid[pp, cp, dp, tp]: TP innermost, then DP, then CP, PP outermost, so
consecutive ranks share a node and a stage maps onto whole nodes. TP talks every layer with
large all-reduces, so it stays innermost (inside an NVLink island); CP comes next: it talks
every layer too (a decode step gathers a small [seqs, heads, head_dim] partial per layer, a
prefill step the queries and partial outputs of its tokens), more than PP, which sends one
activation per stage per step and so can cross the slowest link. Inside a stage each cp rank's
tp*dp ranks are the MoE layers' [ep, moe_tp] grid (moe_tp innermost).

Islands and nodes: every rank sits in one island (an NVLink domain; by default its node) and
one node, given as rank -> island id and rank -> node id (from a plan's placement; by default
one per node: the host, or the Ray node under Ray, as the launcher names it). Each ep group splits into
its islands ("ep_island" groups, ep order inside) and, when those are all one size s, into s
"ep_rail" groups: the ranks at the same position in each island, island order inside. The MoE dispatcher's island-first path moves
rows across islands over a rail and inside an island over its ep_island group only.
"""

from __future__ import annotations

import dataclasses
import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from atoll.comm.group import Group
from atoll.parallel.layout import Layout

KINDS = ("tp", "dp", "cp", "pp", "ep", "moe_tp", "stage", "world", "ep_island", "ep_rail")


@dataclass(frozen=True)
class ContextOptions:
    """What a worker needs besides the layout to make its ParallelContext; picklable.
    islands: rank -> island id (None: the ranks of one node form one island); nodes: rank ->
    node id (None: one per node)."""
    islands: tuple[int, ...] | None = None
    nodes: tuple[int, ...] | None = None

    def __post_init__(self):
        for name in ("islands", "nodes"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, tuple(int(i) for i in getattr(self, name)))


def island_groups(layout: Layout, islands) -> dict[str, list[list[int]]]:
    """The ep_island and ep_rail groups (global ranks) for rank -> island id `islands`
    (None: one island). A rank with no rail (ep islands of unequal sizes) is its own."""
    world = layout.world_size
    island_of = list(islands) if islands is not None else [0] * world
    if len(island_of) != world:
        raise ValueError(f"{len(island_of)} island ids for {world} ranks")
    subs, rails = [], []
    for ep in group_ranks(layout)["ep"]:
        mine: dict[int, list[int]] = {}
        for r in ep:
            mine.setdefault(island_of[r], []).append(r)
        parts = list(mine.values())
        subs += parts
        if len(parts) > 1 and len({len(p) for p in parts}) == 1:
            rails += [[p[i] for p in parts] for i in range(len(parts[0]))]
        else:
            rails += [[r] for r in ep]
    return {"ep_island": subs, "ep_rail": rails}


def rank_grid(layout: Layout) -> torch.Tensor:
    return torch.arange(layout.world_size, device="cpu").view(layout.pp, layout.cp, layout.dp, layout.tp)  # host arithmetic


def group_ranks(layout: Layout, islands=False) -> dict[str, list[list[int]]]:
    """Every group of each kind as lists of global ranks, in group order; islands: rank ->
    island id for the ep_island / ep_rail groups too (None: one island; False: leave them out)."""
    g = rank_grid(layout)
    pp, cp, dp, tp = g.shape
    moe = g.reshape(pp * cp, layout.ep, layout.moe_tp)  # each cp rank's stage ranks as [ep, moe_tp]
    rows = lambda t: [r.tolist() for r in t]  # noqa: E731
    return {
        "tp": rows(g.reshape(-1, tp)),
        "dp": rows(g.permute(0, 1, 3, 2).reshape(-1, dp)),
        "cp": rows(g.permute(0, 2, 3, 1).reshape(-1, cp)),
        "pp": rows(g.permute(1, 2, 3, 0).reshape(-1, pp)),
        "ep": rows(moe.permute(0, 2, 1).reshape(-1, layout.ep)),
        "moe_tp": rows(moe.reshape(-1, layout.moe_tp)),
        "stage": rows(g.reshape(pp, -1)),
        "world": [list(range(layout.world_size))],
        **({} if islands is False else island_groups(layout, islands)),
    }


@dataclass(frozen=True)
class Coords:
    pp: int
    dp: int
    tp: int
    ep: int
    moe_tp: int
    cp: int = 0


def coords(layout: Layout, rank: int) -> Coords:
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} outside world of {layout.world_size}")
    p, rest = divmod(rank, layout.stage_size)
    c, rest = divmod(rest, layout.tp * layout.dp)
    d, t = divmod(rest, layout.tp)
    e, m = divmod(rest, layout.moe_tp)
    return Coords(pp=p, dp=d, tp=t, ep=e, moe_tp=m, cp=c)


class ParallelContext:
    """Built once per process; holds this rank's named Groups and its coordinates."""

    def __init__(self, layout: Layout, rank: int, groups: dict[str, Group], device="cpu",
                 options: ContextOptions | None = None):
        self.layout = layout
        self.rank = rank
        self.groups = groups
        self.coords = coords(layout, rank)
        self.device = torch.device(device)  # this rank's device (launch.device bound it)
        self.options = options or ContextOptions()
        self.island_of = self.options.islands or (0,) * layout.world_size  # rank -> island id
        self.node_of = self.options.nodes or (0,) * layout.world_size  # rank -> node id

    @classmethod
    def single(cls, device="cpu", options: ContextOptions | None = None) -> "ParallelContext":
        """One process, no torch.distributed."""
        return cls(Layout(), 0, {k: Group.single(k, device) for k in KINDS}, device, options)

    @classmethod
    def detached(cls, layout: Layout, rank: int, device="meta",
                 options: ContextOptions | None = None) -> "ParallelContext":
        """Rank `rank`'s groups with their sizes and ranks but no process group: enough to
        build its sharded layers (on meta, say) to check or measure them, never to run them."""
        islands = options.islands if options else None
        groups = {kind: Group(None, ranks, rank, kind, device)
                  for kind, all_ranks in group_ranks(layout, islands).items() for ranks in all_ranks
                  if rank in ranks}
        return cls(layout, rank, groups, device, options)

    @classmethod
    def create(cls, layout: Layout, rank: int, device="cpu",
               options: ContextOptions | None = None, node: str | None = None) -> "ParallelContext":
        """Make every group; all ranks must call this together (new_group is collective).
        Without islands (nodes) in `options`, the ranks of one node form one island (node):
        `node` names this rank's (its launcher says; default the host name)."""
        options = options or ContextOptions()
        if (options.islands is None or options.nodes is None) and layout.world_size > 1:
            hosts = host_islands(layout.world_size, node)
            options = dataclasses.replace(options, islands=options.islands or hosts, nodes=options.nodes or hosts)
        made: dict[tuple, object] = {}  # ranks -> process group, so an ep_island equal to its ep shares it
        groups = {}
        for kind, all_ranks in group_ranks(layout, options.islands).items():
            # islands of unequal sizes (2 + 1 ranks on two nodes): the lone rank's group is made
            # too, unused, so every rank holds as many groups as its peers; torch names a group
            # made later by its members alone (new_group(use_local_synchronization=True), the
            # expert balancer's) after that count, and unequal counts leave its members waiting
            # for each other under different names (pytorch/pytorch#173608)
            lone = kind in ("ep_island", "ep_rail") and any(len(r) > 1 for r in all_ranks)
            for ranks in all_ranks:
                if len(ranks) == 1:
                    if lone:
                        dist.new_group(ranks)
                    pg = None
                elif len(ranks) == layout.world_size:
                    pg = dist.group.WORLD
                elif kind in ("ep_island", "ep_rail") and tuple(ranks) in made:
                    pg = made[tuple(ranks)]
                else:
                    pg = made[tuple(ranks)] = dist.new_group(ranks)
                if rank in ranks:
                    groups[kind] = Group(pg, ranks, rank, kind, device)
        return cls(layout, rank, groups, device, options)

    def release(self) -> None:
        """Let go of every process group (elastic EP, before its groups are torn down): with
        no reference left, a group's connections close as it is destroyed, so a peer still
        blocked in a collective with this rank fails at once instead of at its timeout."""
        for group in self.groups.values():
            group.pg = None

    @property
    def ep_islands(self) -> list[list[int]]:
        """This rank's ep group split into islands, as lists of ep-group ranks (indices)."""
        out: dict[int, list[int]] = {}
        for i, r in enumerate(self.ep.ranks):
            out.setdefault(self.island_of[r], []).append(i)
        return list(out.values())

    tp = property(lambda self: self.groups["tp"])
    dp = property(lambda self: self.groups["dp"])
    cp = property(lambda self: self.groups.get("cp") or Group.single("cp", self.device))
    pp = property(lambda self: self.groups["pp"])
    ep = property(lambda self: self.groups["ep"])
    moe_tp = property(lambda self: self.groups["moe_tp"])
    stage = property(lambda self: self.groups["stage"])
    world = property(lambda self: self.groups["world"])

    @property
    def is_first_stage(self) -> bool:
        return self.coords.pp == 0

    @property
    def is_last_stage(self) -> bool:
        return self.coords.pp == self.layout.pp - 1

    ep_island = property(lambda self: self.groups.get("ep_island", self.groups["ep"]))
    ep_rail = property(lambda self: self.groups.get("ep_rail"))

    def comm_bytes(self) -> dict[str, int]:
        return {k: sum(g.bytes.values()) for k, g in self.groups.items()}


def host_islands(world_size: int, node: str | None = None) -> tuple[int, ...]:
    """rank -> island id, one island per node (collective: every rank calls it with its own
    node name, default the host name; the Ray launcher names Ray's nodes)."""
    hosts = [None] * world_size
    dist.all_gather_object(hosts, node or socket.gethostname())
    ids: dict[str, int] = {}
    return tuple(ids.setdefault(h, len(ids)) for h in hosts)
