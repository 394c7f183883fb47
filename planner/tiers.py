"""How fast the KV cache tiers move a rank's blocks (engine/kv/tiers): the figures a topology gives
or `atoll calibrate` measured (topologies/tiers.py), else sourced defaults, as one rank sees them
with every rank of its node reading its own slice at once.

- host, GPU node: a block read from host memory crosses the GPU's own PCIe link to it, the
  topology's PCIe figure (links.pcie: 64 GB/s a direction for Gen5 x16 on dgx-h200) at
  PCIE_EFFICIENCY (planner/efficiency.py: bandwidthTest/nvbandwidth ~52 of 64 GB/s). A measured
  host copy (kv_tiers.host) is the host side of the same path (the engine joins a block's bytes
  and copies them into pinned memory before the copy up), so the two add: 1/bw = 1/copy + 1/pcie.
- host, CPU machine: the tier is a copy in the same memory: the measured copy, else the
  topology's memory bandwidth at HBM_EFFICIENCY over 2 (a copy reads and writes every byte).
- disk: measured, else one PCIe Gen4 data-centre NVMe drive: ServeTheHome on the Micron 7450
  (176-layer TLC, PCIe Gen4): sequential reads ~6.8 GB/s, writes up to 5.6 GB/s. The drive is
  the node's: its ranks share it.
- shared store: a directory on such a drive or a Redis server, every replica's; the disk's
  figures, and across nodes no faster than the network's per-GPU share at its efficiency.

Latency, a read's fixed cost whatever its size (an estimate, not a measurement): host 20 us, a
hand-off to the rank's reader thread and back; disk and shared store 100 us, a 4 KiB random
read on a data-centre NVMe drive being 70-100 us before the file's open.
"""

from __future__ import annotations

from dataclasses import dataclass

from atoll.planner import efficiency as eff

GB = 1e9
NVME_READ_GB_S, NVME_WRITE_GB_S = 6.8, 5.6
HOST_LATENCY_US, DISK_LATENCY_US = 20.0, 100.0
TIERS = ("host", "disk", "shared")


@dataclass(frozen=True)
class TierSpeed:
    """One tier as one rank sees it: bytes/s of block payload each way, a read's fixed seconds."""
    read_bytes_s: float
    write_bytes_s: float
    latency_s: float
    source: str  # where the figures come from, for the report

    def read_s(self, nbytes: float) -> float:
        """Seconds to read `nbytes` in one read."""
        return self.latency_s + nbytes / self.read_bytes_s

    def describe(self) -> str:
        return (f"read {self.read_bytes_s / GB:.3g} GB/s, write {self.write_bytes_s / GB:.3g} GB/s, "
                f"{self.latency_s * 1e6:.0f} us a read ({self.source})")


def _series(a: float, b: float) -> float:
    return 1.0 / (1.0 / a + 1.0 / b)


def tier_speeds(topology, *, cpu: bool, ranks_on_node: int = 1) -> dict[str, TierSpeed]:
    """host, disk and shared: each tier's speed per rank (module docstring); ranks_on_node: the
    engine's ranks on one node, which share its disk."""
    given = topology.kv_tiers
    share = max(1, ranks_on_node)
    h, d = given.host, given.disk
    if cpu:
        copy = topology.gpu.hbm_tb_s * 1e3 * GB * eff.HBM_EFFICIENCY / 2
        host_r = h.read_gb_s * GB if h.read_gb_s else copy
        host_w = h.write_gb_s * GB if h.write_gb_s else copy
        src = "measured host copy" if h.read_gb_s else "memory bandwidth / 2"
    else:
        link = topology.node_link
        pcie = link.per_gpu_gb_s(topology.gpus_per_node) * GB * eff.link_efficiency(link.kind)
        host_r = _series(h.read_gb_s * GB, pcie) if h.read_gb_s else pcie
        host_w = _series(h.write_gb_s * GB, pcie) if h.write_gb_s else pcie
        src = ("measured host copy, then " if h.read_gb_s else "") + f"{link.kind} {link.gb_s:g} GB/s x " \
            f"{eff.link_efficiency(link.kind):g}"
    host = TierSpeed(host_r, host_w, (h.latency_us if h.latency_us is not None else HOST_LATENCY_US) * 1e-6, src)
    disk_r = (d.read_gb_s or NVME_READ_GB_S) * GB / share
    disk_w = (d.write_gb_s or NVME_WRITE_GB_S) * GB / share
    lat = (d.latency_us if d.latency_us is not None else DISK_LATENCY_US) * 1e-6
    dsrc = ("measured block files" if d.read_gb_s else "one Gen4 NVMe drive") + \
        (f", shared by {share} ranks" if share > 1 else "")
    disk = TierSpeed(disk_r, disk_w, lat, dsrc)
    shared = disk
    if topology.num_nodes > 1:
        net = topology.network
        wire = net.per_gpu_gb_s(topology.gpus_per_node) * GB * eff.link_efficiency(net.kind)
        shared = TierSpeed(min(disk_r, wire), min(disk_w, wire), lat, dsrc + f", over {net.kind}")
    return {"host": host, "disk": disk, "shared": shared}
