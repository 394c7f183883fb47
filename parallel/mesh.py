"""The rank grid and ParallelContext.

Ranks are laid out as grid[pp, dp, tp]: TP innermost, then DP, PP outermost, so
consecutive ranks share a node and a stage maps onto whole nodes. Inside a stage the
MoE layers see the same tp*dp ranks as an [ep, moe_tp] grid (moe_tp innermost).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atoll.comm.group import Group
from atoll.parallel.layout import Layout

KINDS = ("tp", "dp", "pp", "ep", "moe_tp", "stage", "world")


def rank_grid(layout: Layout) -> torch.Tensor:
    return torch.arange(layout.world_size, device="cpu").view(layout.pp, layout.dp, layout.tp)  # host arithmetic


def group_ranks(layout: Layout) -> dict[str, list[list[int]]]:
    """Every group of each kind as lists of global ranks, in group order."""
    g = rank_grid(layout)
    pp, dp, tp = g.shape
    moe = g.reshape(pp, layout.ep, layout.moe_tp)  # stage ranks as [ep, moe_tp]
    rows = lambda t: [r.tolist() for r in t]  # noqa: E731
    return {
        "tp": rows(g.reshape(-1, tp)),
        "dp": rows(g.permute(0, 2, 1).reshape(-1, dp)),
        "pp": rows(g.permute(1, 2, 0).reshape(-1, pp)),
        "ep": rows(moe.permute(0, 2, 1).reshape(-1, layout.ep)),
        "moe_tp": rows(moe.reshape(-1, layout.moe_tp)),
        "stage": rows(g.reshape(pp, -1)),
        "world": [list(range(layout.world_size))],
    }


@dataclass(frozen=True)
class Coords:
    pp: int
    dp: int
    tp: int
    ep: int
    moe_tp: int


def coords(layout: Layout, rank: int) -> Coords:
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank {rank} outside world of {layout.world_size}")
    p, rest = divmod(rank, layout.stage_size)
    d, t = divmod(rest, layout.tp)
    e, m = divmod(rest, layout.moe_tp)
    return Coords(pp=p, dp=d, tp=t, ep=e, moe_tp=m)


class ParallelContext:
    """Built once per process; holds this rank's named Groups and its coordinates."""

    def __init__(self, layout: Layout, rank: int, groups: dict[str, Group], device="cpu"):
        self.layout = layout
        self.rank = rank
        self.groups = groups
        self.coords = coords(layout, rank)
        self.device = torch.device(device)  # this rank's device (launch.device bound it)

    @classmethod
    def single(cls, device="cpu") -> "ParallelContext":
        """One process, no torch.distributed."""
        return cls(Layout(), 0, {k: Group.single(k, device) for k in KINDS}, device)

    @classmethod
    def detached(cls, layout: Layout, rank: int, device="meta") -> "ParallelContext":
        """Rank `rank`'s groups with their sizes and ranks but no process group: enough to
        build its sharded layers (on meta, say) to check or measure them, never to run them."""
        groups = {kind: Group(None, ranks, rank, kind, device)
                  for kind, all_ranks in group_ranks(layout).items() for ranks in all_ranks if rank in ranks}
        return cls(layout, rank, groups, device)

    @classmethod
    def create(cls, layout: Layout, rank: int, device="cpu") -> "ParallelContext":
        """Make every group; all ranks must call this together (new_group is collective)."""
        import torch.distributed as dist

        groups = {}
        for kind, all_ranks in group_ranks(layout).items():
            for ranks in all_ranks:
                if len(ranks) == 1:
                    pg = None
                elif len(ranks) == layout.world_size:
                    pg = dist.group.WORLD
                else:
                    pg = dist.new_group(ranks)
                if rank in ranks:
                    groups[kind] = Group(pg, ranks, rank, kind, device)
        return cls(layout, rank, groups, device)

    tp = property(lambda self: self.groups["tp"])
    dp = property(lambda self: self.groups["dp"])
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

    def comm_bytes(self) -> dict[str, int]:
        return {k: sum(g.bytes.values()) for k, g in self.groups.items()}
