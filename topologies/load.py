"""Topologies from YAML: a preset name (topologies/presets/NAME.yaml) or a file path.

A file describes one node type and, optionally, how many nodes:

    name: dgx-h200
    nodes: 1                  # --nodes overrides
    gpus_per_node: 8
    gpu: {name: H200-SXM, memory_gib: 140.4, hbm_tb_s: 4.8, bf16_tflops: 989, fp8_tflops: 1979}
    islands: 8                # GPUs per NVLink domain (may exceed a node: 72 on GB200 NVL72),
                              # or a list of local GPU lists per node: [[0, 1], [2, 3]]; 1: none
    links:
      nvlink:  {gb_s: 450, latency_us: 3}
      pcie:    {gb_s: 64, latency_us: 5}
      network: {kind: infiniband, gb_s: 50, latency_us: 5}     # shared: true for one port per node
    kv_tiers:                 # optional: the KV cache tiers' bandwidths (topologies/tiers.py)
      host: {read_gb_s: 40, write_gb_s: 40}
      disk: {read_gb_s: 6.8, write_gb_s: 5.3, latency_us: 100}
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import yaml

from atoll.errors import ConfigError
from atoll.topologies.calibration import Calibration
from atoll.topologies.schema import GpuSpec, Link, Node, Topology
from atoll.topologies.tiers import kv_tiers_from_dict


def read_yaml(path: Path, where: str, expected: str):
    """The YAML document at path; ConfigError naming `where` if it cannot be read or parsed."""
    try:
        return yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as e:
        raise ConfigError(f"cannot read {where}: {e.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{where}: not a text file; expected {expected}") from None
    except yaml.YAMLError as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ConfigError(f"{where}: not valid YAML: {first}") from None

PRESET_DIR = Path(__file__).parent / "presets"
MAX_GPUS = 2**17  # a bound on nodes x gpus_per_node, so a typo (nodes: 100000000) fails at once


def preset_names() -> list[str]:
    return sorted(p.stem for p in PRESET_DIR.glob("*.yaml"))


def _need(d: dict, key: str, where: str, what: str):
    if not isinstance(d, dict) or key not in d:
        raise ConfigError(f"{where}: missing field '{what}'")
    return d[key]


def _gpu(d: dict, where: str, ranks_per_node: int) -> GpuSpec:
    kw = {k: _need(d, k, where, f"gpu.{k}") for k in ("name", "memory_gib", "hbm_tb_s", "bf16_tflops")}
    if kw["memory_gib"] == "auto":  # the local preset: this machine's RAM shared by its CPU ranks
        ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        kw["memory_gib"] = ram / 2**30 / ranks_per_node
    unknown = set(d) - set(kw) - {"fp8_tflops", "fp32_tflops"}
    if unknown:
        raise ConfigError(f"{where}: unknown field 'gpu.{sorted(unknown)[0]}'")
    try:
        return GpuSpec(**{**kw, "name": str(kw["name"])}, fp8_tflops=d.get("fp8_tflops", 0.0),
                       fp32_tflops=d.get("fp32_tflops", 0.0))
    except ConfigError as e:
        raise ConfigError(f"{where}: gpu: {e}") from None


def _link(d, kind: str | None, where: str, what: str) -> Link:
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: '{what}' must be a mapping with gb_s and latency_us")
    kind = d.get("kind", kind)
    if kind is None:
        raise ConfigError(f"{where}: missing field '{what}.kind'")
    gb_s = _need(d, "gb_s", where, f"{what}.gb_s")
    latency_us = _need(d, "latency_us", where, f"{what}.latency_us")
    try:
        return Link(kind=kind, gb_s=gb_s, latency_us=latency_us, shared=d.get("shared", False))
    except ConfigError as e:
        raise ConfigError(f"{where}: {what}: {e}") from None


def _islands(spec, nodes: int, gpn: int, where: str) -> list[tuple[tuple[int, int], ...]]:
    total = nodes * gpn
    if isinstance(spec, bool) or not isinstance(spec, (int, list)):
        raise ConfigError(f"{where}: islands={spec!r} must be a GPU count or a list of GPU lists")
    if isinstance(spec, list):  # the same local grouping on every node
        if not all(isinstance(group, list) and all(isinstance(g, int) and not isinstance(g, bool)
                                                   for g in group) for group in spec):
            raise ConfigError(f"{where}: islands={spec!r} must be lists of local GPU numbers, "
                              f"e.g. [[0, 1], [2, 3]], or one GPU count per island, e.g. {gpn}")
        local = [tuple(group) for group in spec]
        count = sum(len(g) for g in local)
        if count != gpn or sorted(g for grp in local for g in grp) != list(range(gpn)):
            raise ConfigError(
                f"{where}: islands {spec} cover {count} GPUs but gpus_per_node is {gpn}; "
                f"list each of GPUs 0..{gpn - 1} once"
            )
        return [tuple((n, g) for g in grp) for n in range(nodes) for grp in local]
    size = spec
    if size < 1:
        raise ConfigError(f"{where}: islands={size} must be at least 1")
    if size <= gpn and gpn % size:
        raise ConfigError(f"{where}: islands of {size} GPUs do not divide gpus_per_node={gpn}")
    if size > gpn and size % gpn:
        raise ConfigError(f"{where}: an island of {size} GPUs is not a whole number of {gpn}-GPU nodes")
    if size < total and total % size:
        raise ConfigError(
            f"{where}: {nodes} nodes x {gpn} GPUs = {total} GPUs do not split into islands of {size}"
        )
    order = [(n, g) for n in range(nodes) for g in range(gpn)]
    return [tuple(order[i:i + size]) for i in range(0, total, size)]


def topology_from_dict(d: dict, *, nodes: int | None = None, gpus_per_node: int | None = None,
                       where: str = "topology") -> Topology:
    if not isinstance(d, dict):
        raise ConfigError(f"{where}: expected a YAML mapping, got {type(d).__name__}")
    if gpus_per_node is not None:  # part of a node: "4 x H200" from the dgx-h200 preset
        if isinstance(gpus_per_node, bool) or not isinstance(gpus_per_node, int) or gpus_per_node < 1:
            raise ConfigError(f"gpus_per_node={gpus_per_node!r} must be a positive integer")
        has = d.get("gpus_per_node")
        has = (os.cpu_count() or 1) if has == "auto" else has
        if isinstance(has, int) and not isinstance(has, bool) and gpus_per_node > has:
            raise ConfigError(f"gpus_per_node={gpus_per_node} exceeds the {has} GPUs per node of {where}; "
                              f"give at most {has}")
        d = dict(d)
        if d.get("islands") == d.get("gpus_per_node"):
            d["islands"] = gpus_per_node
        d["gpus_per_node"] = gpus_per_node
    name = str(_need(d, "name", where, "name"))
    gpn = _need(d, "gpus_per_node", where, "gpus_per_node")
    if gpn == "auto":
        gpn = os.cpu_count() or 1
    if isinstance(gpn, bool) or not isinstance(gpn, int) or gpn < 1:
        raise ConfigError(f"{where}: gpus_per_node={gpn!r} must be a positive integer")
    count = d.get("nodes", 1) if nodes is None else nodes
    if isinstance(count, bool) or not isinstance(count, int) or count < 1:
        raise ConfigError(f"{where}: nodes={count!r} must be at least 1")
    if count * gpn > MAX_GPUS:
        raise ConfigError(f"{where}: {count} nodes x {gpn} GPUs = {count * gpn} GPUs; "
                          f"atoll describes at most {MAX_GPUS}")
    gpu = _gpu(_need(d, "gpu", where, "gpu"), where, gpn)
    links = _need(d, "links", where, "links")
    network = _link(_need(links, "network", where, "links.network"), None, where, "links.network")
    pcie = _link(_need(links, "pcie", where, "links.pcie"), "pcie", where, "links.pcie")
    nvlink = _link(links["nvlink"], "nvlink", where, "links.nvlink") if "nvlink" in links else None
    islands = _islands(d.get("islands", 1), count, gpn, where)
    if nvlink is None and any(len(i) > 1 for i in islands):
        raise ConfigError(f"{where}: islands of more than one GPU need links.nvlink")
    node_names = d.get("node_names") or [f"node{i}" for i in range(count)]
    if not isinstance(node_names, list):
        raise ConfigError(f"{where}: node_names={node_names!r} must be a list of {count} names")
    if len(node_names) != count:
        raise ConfigError(f"{where}: {len(node_names)} node_names for {count} nodes")
    topo_nodes = tuple(Node(name=str(n), gpus=gpn, gpu=gpu) for n in node_names)
    calibration = None
    if d.get("calibration") is not None:  # measured by `atoll calibrate`
        calibration = Calibration.from_dict(d["calibration"], where=f"{where}: calibration")
    return Topology(name=name, nodes=topo_nodes, islands=tuple(islands),
                    island_link=nvlink or pcie, node_link=pcie, network=network,
                    notes=str(d.get("notes", "")), calibration=calibration,
                    kv_tiers=kv_tiers_from_dict(d.get("kv_tiers"), where))


def load_topology(name_or_path: str, *, nodes: int | None = None, gpus_per_node: int | None = None,
                  network: str | None = None) -> Topology:
    """A preset name (`dgx-h200`) or a YAML file; `nodes` multiplies the node it describes,
    `gpus_per_node` takes part of each node, `network` ("ethernet:25", "infiniband:400",
    kind:Gb/s) replaces the links between nodes."""
    if nodes is not None and (isinstance(nodes, bool) or not isinstance(nodes, int) or nodes < 1):
        raise ConfigError(f"nodes={nodes!r} must be at least 1")
    text = str(name_or_path)
    path = Path(text)
    if path.suffix in (".yaml", ".yml") or path.is_file():
        if not path.is_file():
            raise ConfigError(f"no topology file at {text}")
        where = path.name
    elif text in preset_names():
        path, where = PRESET_DIR / f"{text}.yaml", f"preset {text}"
    else:
        raise ConfigError(f"unknown topology {text!r}; known presets: {', '.join(preset_names())}")
    data = read_yaml(path, where, "a topology YAML")
    topo = topology_from_dict(data, nodes=nodes, gpus_per_node=gpus_per_node, where=where)
    return with_network(topo, network) if network else topo


# kind -> (one link per GPU?, latency in us): RDMA NICs come one per GPU on DGX/HGX boxes;
# an Ethernet port is one per node, through the kernel's TCP stack (tens of us per message)
_NETWORKS = {"infiniband": (False, 5.0), "roce": (False, 8.0), "ethernet": (True, 25.0)}


def with_network(topology: Topology, spec: str) -> Topology:
    """Replace the inter-node links: "ethernet:25" is one 25 Gb/s port per node."""
    kind, _, rate = spec.partition(":")
    if kind not in _NETWORKS or not rate.replace(".", "", 1).isdigit() or float(rate) <= 0:
        raise ConfigError(f"network {spec!r}: expected KIND:GBITS with KIND one of "
                          f"{', '.join(_NETWORKS)}, e.g. ethernet:25 or infiniband:400")
    shared, latency = _NETWORKS[kind]
    link = Link(kind=kind, gb_s=float(rate) / 8, latency_us=latency, shared=shared)
    return dataclasses.replace(topology, name=f"{topology.name}+{spec}", network=link)
