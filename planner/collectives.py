"""Time of one collective over the links a placement gives a group of ranks.

A group is described by where its ranks sit: how many share an island with each other, how
many islands it spans and whether those islands are on one node (PCIe between them) or on
several (the network). Bandwidth is each link's per-GPU, per-direction figure times its
efficiency (efficiency.py); latency is the link's per-message figure from the topology.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np

from atoll.planner.efficiency import link_efficiency
from atoll.planner.parts import is_many, vmax


@dataclass(frozen=True)
class GroupLinks:
    size: int  # ranks in the group
    per_island: int  # ranks of the group inside one island
    islands: int  # islands the group spans
    island_bw: float  # bytes/s per GPU inside an island, after efficiency
    island_lat: float  # seconds per message inside an island
    cross_bw: float  # bytes/s per GPU between islands, after efficiency and sharing
    cross_lat: float
    cross_kind: str  # link kind between islands ("" if one island)
    measured: object = None  # the topology's Calibration: measured collectives replace the link model
    island_kind: str = "nvlink"  # link kind inside an island (pcie or shm where there is no NVLink)

    @classmethod
    def of(cls, ranks: list[int], placement, topology) -> "GroupLinks":
        size = len(ranks)
        islands = {placement.island_of(r) for r in ranks}
        nodes = {placement.node_of(r) for r in ranks}
        il = topology.island_link
        island_bw = il.gb_s * 1e9 * link_efficiency(il.kind)
        cross = topology.node_link if len(nodes) == 1 else topology.network
        # ranks of this group on one node share a link marked shared (one Ethernet port)
        on_node = max(1, size // len(nodes))
        cross_bw = (cross.gb_s / on_node if cross.shared else cross.gb_s) * 1e9 * link_efficiency(cross.kind)
        return cls(size=size, per_island=max(1, size // len(islands)), islands=len(islands),
                   island_bw=island_bw, island_lat=il.latency_us * 1e-6, cross_bw=cross_bw,
                   cross_lat=cross.latency_us * 1e-6, cross_kind=cross.kind if len(islands) > 1 else "",
                   measured=topology.calibration, island_kind=il.kind)

    @property
    def kind(self) -> str:
        return self.cross_kind or self.island_kind

    @functools.cached_property
    def island(self) -> "GroupLinks":
        """The part of the group inside one island."""
        return dataclasses.replace(self, size=self.per_island, islands=1, cross_kind="")


def _steps(n: int) -> int:
    return math.ceil(math.log2(n)) if n > 1 else 0


def _moving(nbytes, t):
    """t where there are bytes to move, else 0 (numbers, or arrays of them)."""
    if is_many(nbytes):
        return np.where(nbytes > 0, t, 0.0)
    return t if nbytes > 0 else 0.0


def _measured(op: str, nbytes, g: GroupLinks, size: int | None = None):
    """latency + bytes / bandwidth of `op` as `atoll calibrate` measured it over `size` ranks
    (default the group's); None where the topology holds no such figure."""
    fig = g.measured.collective(op, size or g.size) if g.measured is not None else None
    return None if fig is None else fig[0] + nbytes / fig[1]


def all_reduce(nbytes, g: GroupLinks):
    """Hierarchical all-reduce: reduce-scatter/all-gather inside the island (ring bandwidth
    2(k-1)/k), all-reduce of the 1/k shard between islands; latency of a tree (2 log2 n hops).
    Measured instead where the topology is calibrated. `nbytes` may be an array."""
    if g.size <= 1:
        return 0.0
    if (t := _measured("all_reduce", nbytes, g)) is not None:
        return _moving(nbytes, t)
    k, m = g.per_island, g.islands
    t = 2 * (k - 1) / k * nbytes / g.island_bw + 2 * _steps(k) * g.island_lat
    if m > 1:
        t += 2 * (m - 1) / m * (nbytes / k) / g.cross_bw + 2 * _steps(m) * g.cross_lat
    return _moving(nbytes, t)


def all_gather(nbytes, g: GroupLinks):
    """All-gather of a tensor of `nbytes` in total (each rank holds nbytes/size). The other
    islands' (m-1)/m of it enters an island once, each of its k ranks bringing 1/k over its
    own link (NCCL's rings cross between nodes on every NIC; cross_bw is a GPU's share of the
    link), and is shared inside the island, as all_reduce's cross-island step is."""
    if g.size <= 1:
        return 0.0
    if (t := _measured("all_gather", nbytes, g)) is not None:
        return _moving(nbytes, t)
    k, m = g.per_island, g.islands
    t = (k - 1) / k * nbytes / g.island_bw + _steps(k) * g.island_lat
    if m > 1:
        t += (m - 1) / m * (nbytes / k) / g.cross_bw + _steps(m) * g.cross_lat
    return _moving(nbytes, t)


def all_to_all(bytes_out, g: GroupLinks):
    """Each rank sends `bytes_out`, spread evenly over the group's ranks (MoE dispatch with
    uniform routing): the share for ranks in other islands crosses the slower link, in
    parallel with the NVLink share; one message latency of the slowest link class."""
    if g.size <= 1:
        return 0.0
    if (t := _measured("all_to_all", bytes_out, g)) is not None:
        return _moving(bytes_out, t)
    local = bytes_out * (g.per_island - 1) / g.size
    remote = bytes_out * (g.size - g.per_island) / g.size
    t_local = local / g.island_bw
    t_remote = remote / g.cross_bw if g.size > g.per_island else 0.0
    lat = 2 * (g.cross_lat if g.islands > 1 else g.island_lat)  # send, then completion signal
    return _moving(bytes_out, vmax(t_local, t_remote) + lat)


def island_first_all_to_all(cross_bytes, intra_bytes, g: GroupLinks):
    """The MoE Dispatcher's island-first exchange (comm/dispatch.py; DeepEP's internode kernels
    do the same): each rank sends `cross_bytes` to the ranks at its own position in the other
    islands, over its own link between islands (one NIC per GPU on DGX nodes: the figure is per
    GPU already), then `intra_bytes`, spread over its island's ranks (itself included). The
    runtime runs the two legs one after the other, as two all-to-alls."""
    if g.islands <= 1:
        return all_to_all(intra_bytes, g)
    cross = _measured("all_to_all", cross_bytes, g, size=g.islands)
    if cross is None:
        cross = cross_bytes / g.cross_bw + 2 * g.cross_lat  # send, then completion signal
    return _moving(cross_bytes, cross) + all_to_all(intra_bytes, g.island)


def send_recv(nbytes, senders: int, g: GroupLinks):
    """A pipeline hand-off of `nbytes` split over `senders` parallel rank pairs."""
    if (t := _measured("send_recv", nbytes / senders, g, size=2)) is not None:  # each pair in parallel
        return _moving(nbytes, t)
    bw, lat = (g.cross_bw, g.cross_lat) if g.islands > 1 else (g.island_bw, g.island_lat)
    return _moving(nbytes, nbytes / senders / bw + lat)
