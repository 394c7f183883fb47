"""Cluster description: GPUs, nodes, NVLink islands and the links between them.

Bandwidths are per GPU and per direction in GB/s (1e9 bytes/s): a data sheet's "900 GB/s
NVLink" is bidirectional, so 450 here. A link marked `shared` is one pipe for the whole node
(a single Ethernet port); otherwise every GPU has its own (NVLink ports, one NIC per GPU).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from atoll.errors import ConfigError
from atoll.topologies.tiers import KvTierLinks

LINK_KINDS = ("nvlink", "pcie", "infiniband", "roce", "ethernet", "shm")

GpuId = tuple[int, int]  # (node index, local GPU index)


def _number(v, *, positive: bool) -> bool:
    """A finite int or float (not a bool, not NaN), > 0 or >= 0."""
    ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
    return ok and (v > 0 if positive else v >= 0)


@dataclass(frozen=True)
class GpuSpec:
    name: str
    memory_gib: float  # usable HBM as the driver reports it, GiB
    hbm_tb_s: float  # peak HBM bandwidth, TB/s
    bf16_tflops: float  # dense tensor-core peak
    fp8_tflops: float = 0.0  # 0: no fp8 tensor cores; fp8 weights are upcast and run at bf16 rate
    fp32_tflops: float = 0.0  # 0: half the bf16 rate (TF32 tensor cores: H100 SXM 494.7 dense of 989.4 bf16, data sheet)

    def __post_init__(self):
        for name in ("memory_gib", "hbm_tb_s", "bf16_tflops"):
            v = getattr(self, name)
            if not _number(v, positive=True):
                raise ConfigError(f"GPU {self.name!r}: {name}={v!r} must be a positive number")
        for name in ("fp8_tflops", "fp32_tflops"):
            if not _number(getattr(self, name), positive=False):
                raise ConfigError(f"GPU {self.name!r}: {name}={getattr(self, name)!r} must be a number >= 0")

    @property
    def memory_bytes(self) -> float:
        return self.memory_gib * 2**30

    def tflops(self, dtype: str) -> float:
        if dtype == "fp32":
            return self.fp32_tflops or self.bf16_tflops / 2
        return self.fp8_tflops if dtype == "fp8" and self.fp8_tflops > 0 else self.bf16_tflops


@dataclass(frozen=True)
class Link:
    kind: str
    gb_s: float  # per direction; per GPU unless shared
    latency_us: float  # one message, one hop, including the software that posts it
    shared: bool = False  # one link for the whole node instead of one per GPU

    def __post_init__(self):
        if not isinstance(self.kind, str) or self.kind not in LINK_KINDS:
            raise ConfigError(f"link kind {self.kind!r} is not one of {', '.join(LINK_KINDS)}")
        if not _number(self.gb_s, positive=True):
            raise ConfigError(f"{self.kind} link: gb_s={self.gb_s!r} must be a positive number")
        if not _number(self.latency_us, positive=False):
            raise ConfigError(f"{self.kind} link: latency_us={self.latency_us!r} must be a number >= 0")
        if not isinstance(self.shared, bool):
            raise ConfigError(f"{self.kind} link: shared={self.shared!r} must be true or false")

    def per_gpu_gb_s(self, gpus_on_node: int) -> float:
        """Bandwidth one GPU gets when all GPUs of its node use the link at once."""
        return self.gb_s / gpus_on_node if self.shared else self.gb_s

    def __str__(self) -> str:
        share = " per node" if self.shared else " per GPU"
        return f"{self.kind} {self.gb_s:g} GB/s{share}, {self.latency_us:g} us"


@dataclass(frozen=True)
class Node:
    name: str
    gpus: int
    gpu: GpuSpec

    def __post_init__(self):
        if not isinstance(self.gpus, int) or isinstance(self.gpus, bool) or self.gpus < 1:
            raise ConfigError(f"node {self.name!r}: gpus={self.gpus!r} must be a positive integer")


@dataclass(frozen=True)
class Topology:
    """Nodes, NVLink islands (sets of (node, gpu) that may span nodes), and three link classes:
    inside an island, between GPUs of a node outside an island, and between nodes."""

    name: str
    nodes: tuple[Node, ...]
    islands: tuple[tuple[GpuId, ...], ...]
    island_link: Link
    node_link: Link
    network: Link
    notes: str = field(default="", compare=False)
    calibration: object = field(default=None, compare=False)  # topologies.calibration.Calibration: measured
    kv_tiers: KvTierLinks = field(default=KvTierLinks(), compare=False)  # the KV cache tiers' bandwidths (tiers.py)

    def __post_init__(self):
        if not self.nodes:
            raise ConfigError(f"topology {self.name!r} has no nodes")
        every = [(n, g) for n, node in enumerate(self.nodes) for g in range(node.gpus)]
        seen: dict[GpuId, int] = {}
        for i, island in enumerate(self.islands):
            if not island:
                raise ConfigError(f"topology {self.name!r}: island {i} is empty")
            for gid in island:
                n, g = gid
                if not (0 <= n < len(self.nodes) and 0 <= g < self.nodes[n].gpus):
                    raise ConfigError(
                        f"topology {self.name!r}: island {i} names GPU {g} of node {n}, "
                        f"which does not exist ({len(self.nodes)} nodes x {self.nodes[0].gpus} GPUs)"
                    )
                if gid in seen:
                    raise ConfigError(
                        f"topology {self.name!r}: GPU {g} of node {n} is in islands {seen[gid]} and {i}"
                    )
                seen[gid] = i
        if len(seen) != len(every):
            raise ConfigError(
                f"topology {self.name!r}: islands cover {len(seen)} GPUs but the "
                f"{len(self.nodes)} node(s) have {len(every)}"
            )
        object.__setattr__(self, "_island_of", seen)

    @property
    def num_gpus(self) -> int:
        return sum(n.gpus for n in self.nodes)

    @property
    def num_nodes(self) -> int:
        return len(self.nodes)

    @property
    def gpus_per_node(self) -> int:
        return self.nodes[0].gpus

    @property
    def gpu(self) -> GpuSpec:
        """The GPU of the first node; the planner assumes one GPU type per cluster."""
        return self.nodes[0].gpu

    @property
    def island_size(self) -> int:
        """The smallest island: the largest TP group that fits in any island."""
        return min(len(i) for i in self.islands)

    def island_of(self, gid: GpuId) -> int:
        return self._island_of[gid]

    def gpu_order(self) -> list[GpuId]:
        """Every GPU, island by island, so consecutive ranks share an island."""
        return [gid for island in self.islands for gid in island]

    def link_between(self, a: GpuId, b: GpuId) -> Link:
        if self.island_of(a) == self.island_of(b):
            return self.island_link
        if a[0] == b[0]:
            return self.node_link
        return self.network

    def describe(self) -> str:
        sizes = sorted({len(i) for i in self.islands})
        g = self.gpu
        islands = (f"{len(self.islands)} NVLink island(s) of {'/'.join(map(str, sizes))} GPUs"
                   if sizes != [1] else "no NVLink")
        return (f"{self.name}: {self.num_nodes} node(s) x {self.gpus_per_node} {g.name} = "
                f"{self.num_gpus} GPUs; {islands}")
