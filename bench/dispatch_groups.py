"""The ranks' side of `atoll bench dispatch` and its sweep: simulated islands, the slow-link
group wrapper, the groups every side uses, and the rotating timing of the sides (bench/dispatch.py
says what each does)."""

from __future__ import annotations

import ctypes
import ctypes.util
import math
import time

import torch

from atoll.comm.group import Group
from atoll.comm.routing import expert_split, expert_starts
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ContextOptions, ParallelContext

GROUPS = ("ep", "ep_island", "ep_rail")  # the groups the dispatchers use (and the sleeps are kept for)
CLASSES = ("intra", "cross")


def island_sets(ep: int, n: int) -> list[list[int]]:
    """n contiguous islands over ep ranks, sizes as even as possible."""
    sizes = expert_split(ep, n)
    return [list(range(s, s + m)) for s, m in zip(expert_starts(sizes), sizes)]


def keep_freed_memory() -> bool:
    """glibc: serve buffers up to 32 MiB from the heap and never trim it. False elsewhere."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        m_trim_threshold, m_top_pad, m_mmap_threshold = -1, -2, -3
        return bool(libc.mallopt(m_mmap_threshold, 32 << 20) and libc.mallopt(m_trim_threshold, 1 << 30)
                    and libc.mallopt(m_top_pad, 64 << 20))
    except (OSError, AttributeError):
        return False


def slow_group(group, island_of, gb_s: float | None, latency_us: float | None):
    """`group` (a comm.group.Group) as a SlowGroup: the same process group, whose collectives
    sleep as the module docstring says when its members span islands. island_of: global rank ->
    island id."""
    class SlowGroup(Group):
        def __init__(self):
            super().__init__(group.pg, group.ranks, group.ranks[group.rank], group.name, group.device)
            mine = island_of[self.ranks[self.rank]]
            self.remote = [island_of[r] != mine for r in self.ranks]  # per member: across the link
            self.per_byte_s = 1 / (gb_s * 1e9) if gb_s else 0.0
            self.latency_s = (latency_us or 0.0) * 1e-6
            self.slept_s = 0.0  # the simulated delay so far

        def pause(self, sent: int, received: int) -> None:
            """Sleep for one collective that sent and received these bytes across islands."""
            if any(self.remote):
                s = self.latency_s + max(sent, received) * self.per_byte_s
                self.slept_s += s
                time.sleep(s)

        def across(self, splits, row: int) -> int:
            return row * sum(n for n, far in zip(splits, self.remote) if far)

        # async_op (two-batch overlap): the simulated link time is slept at the start, so it
        # does not overlap; the benches here run one batch a step
        def all_to_all(self, x, send_splits, recv_splits, *, async_op=False):
            out = super().all_to_all(x, send_splits, recv_splits, async_op=async_op)
            row = math.prod(x.shape[1:]) * x.element_size()
            self.pause(self.across(send_splits, row), self.across(recv_splits, row))
            return out

        def all_gather(self, x, dim=-1, *, async_op=False):
            out = super().all_gather(x, dim, async_op=async_op)
            n = x.numel() * x.element_size() * sum(self.remote)
            self.pause(n, n)
            return out

        def reduce_scatter(self, x, dim=0, *, async_op=False):
            out = super().reduce_scatter(x, dim, async_op=async_op)
            n = x.numel() * x.element_size() * sum(self.remote) // self.size
            self.pause(n, n)
            return out

        def all_reduce(self, x, op="sum", *, async_op=False):
            out = super().all_reduce(x, op, async_op=async_op)
            n = 2 * x.numel() * x.element_size() * sum(self.remote) // self.size
            self.pause(n, n)
            return out

        def broadcast(self, x, src=0):
            out = super().broadcast(x, src)
            n = x.numel() * x.element_size()
            self.pause(n * sum(self.remote) if self.rank == src else 0, n * self.remote[src])
            return out

    return SlowGroup()


def make_groups(rank: int, world: int, cfg: dict):
    """(islands, the plain ep group for barriers and results, {name: group} of GROUPS for the
    dispatchers, SlowGroups when the link is simulated). Collective: every rank calls it."""
    islands = island_sets(world, cfg["islands"])
    island_of = tuple(i for i, isl in enumerate(islands) for _ in isl)  # rank -> island id
    ctx = ParallelContext.create(Layout.parse(f"EP{world}"), rank, options=ContextOptions(islands=island_of))
    groups = {name: ctx.groups[name] for name in GROUPS}
    if cfg["simulated"]:
        groups = {n: slow_group(g, island_of, cfg["cross_gb_s"], cfg["cross_latency_us"]) for n, g in groups.items()}
    return islands, ctx.ep, groups


def time_sides(sides: dict, plain, groups: dict, warmup: int, iters: int):
    """Run each side once per iteration, in an order rotated by one each time, after a barrier.
    Returns the slowest rank's wall seconds [iters, sides], all ranks' CPU seconds [iters, sides]
    and this rank's simulated sleep per iteration [sides, groups] (GROUPS order)."""
    names = list(sides)
    times = torch.zeros(iters, len(names), 2, dtype=torch.float64)  # [.., .., wall / cpu]
    slept = torch.zeros(len(names), len(GROUPS), dtype=torch.float64)
    for i in range(warmup + iters):
        shift = i % len(names)
        for j in list(range(shift, len(names))) + list(range(shift)):
            plain.barrier()
            before = [getattr(groups[g], "slept_s", 0.0) for g in GROUPS]
            t0, c0 = time.perf_counter(), time.process_time()
            sides[names[j]]()
            t1, c1 = time.perf_counter(), time.process_time()
            if i >= warmup:
                times[i - warmup, j] = torch.tensor([t1 - t0, c1 - c0], dtype=torch.float64)
                slept[j] += torch.tensor([getattr(groups[g], "slept_s", 0.0) - b for g, b in zip(GROUPS, before)],
                                         dtype=torch.float64)
    every = plain.all_gather(times[None], dim=0)  # [ep, iters, sides, 2]
    return every[..., 0].amax(dim=0), every[..., 1].sum(dim=0), slept / iters
