"""Live discovery: NVML (nvidia-ml-py), the text of `nvidia-smi topo -m`, a running Ray cluster.

NVML and Ray are imported inside the functions that use them, so `import atoll` works on a
machine without either. GPU figures (TFLOPS, HBM bandwidth) are not discoverable; they come
from the preset whose GPU name matches, and links from that preset's data sheet values.
"""

from __future__ import annotations

import dataclasses
import shutil
import subprocess

import yaml

from atoll.errors import ConfigError
from atoll.topologies.load import PRESET_DIR, load_topology, topology_from_dict
from atoll.topologies.schema import GpuSpec, Link, Node, Topology
from atoll.topologies.smi import parse_smi_topo

# GPU name fragment -> the preset holding its data sheet figures; first match wins
_BY_NAME = (("GB200", "gb200-nvl72"), ("B200", "dgx-b200"), ("H200", "dgx-h200"),
            ("H800", "hgx-h800"), ("H100", "dgx-h100"), ("A100-PCIE", "a100-pcie"),
            ("A100 PCIE", "a100-pcie"), ("A100", "a100-sxm"), ("L40S", "l40s-pcie"))
NVLINK_GB_S_PER_LINK = 25.0  # NVLink 2/3/4: 50 GB/s bidirectional per link (V100, A100, H100 sheets)


def preset_for_gpu(name: str) -> str | None:
    up = name.upper()
    return next((preset for frag, preset in _BY_NAME if frag in up), None)


def gpu_spec_for(name: str, memory_gib: float | None = None) -> GpuSpec:
    """The data-sheet spec for a GPU name; an unknown GPU gets placeholder figures of 1."""
    preset = preset_for_gpu(name)
    if preset is None:
        return GpuSpec(name=f"{name} (figures unknown)", memory_gib=memory_gib or 1.0,
                       hbm_tb_s=1.0, bf16_tflops=1.0)
    spec = load_topology(preset).gpu
    return dataclasses.replace(spec, memory_gib=memory_gib) if memory_gib else spec


def _build(name: str, islands_local: list[list[int]], gpu: GpuSpec, nvlink_gb_s: float,
           nodes: int, network: Link, node_names: list[str] | None = None, notes: str = "") -> Topology:
    names = node_names or [f"node{i}" for i in range(nodes)]
    gpn = sum(len(i) for i in islands_local)
    topo_nodes = tuple(Node(name=n, gpus=gpn, gpu=gpu) for n in names)
    islands = tuple(tuple((n, g) for g in isl) for n in range(len(names)) for isl in islands_local)
    pcie = Link("pcie", 32.0, 5.0)  # PCIe Gen4 x16 each way: the conservative default
    nv = Link("nvlink", nvlink_gb_s, 3.0) if nvlink_gb_s > 0 else pcie
    return Topology(name=name, nodes=topo_nodes, islands=islands, island_link=nv, node_link=pcie,
                    network=network, notes=notes)


def _network_guess(per_gpu_nics: bool) -> Link:
    # One NIC per GPU (DGX/HGX): assume 400 Gb/s NDR InfiniBand; otherwise one 100 Gb/s port.
    if per_gpu_nics:
        return Link("infiniband", 50.0, 5.0)
    return Link("roce", 12.5, 8.0, shared=True)


def topology_from_smi(text: str, *, gpu: GpuSpec | None = None, nodes: int = 1,
                      name: str = "nvidia-smi") -> Topology:
    """A Topology from `nvidia-smi topo -m` text: islands are the NVLink-connected GPU sets."""
    m = parse_smi_topo(text)
    islands = m.islands()
    n = len(m.gpus)
    links = [m.nvlinks(a, b) for isl in islands for a in isl for b in isl if a < b and m.nvlinks(a, b)]
    nvlink = NVLINK_GB_S_PER_LINK * min(links) if links else 0.0
    per_gpu = bool(m.nics) and all(m.near_nics(g) for g in range(n))
    notes = "network guessed from the NIC layout" + ("; NIC rows cut short" if m.truncated else "")
    return _build(name, islands, gpu or gpu_spec_for("unknown"), nvlink, nodes,
                  _network_guess(per_gpu), notes=notes)


def topology_from_nvml(*, nodes: int = 1) -> Topology:
    """This node's GPUs and NVLink peers from NVML; other nodes assumed identical."""
    try:
        import pynvml
    except ImportError:
        raise ConfigError("NVML discovery needs nvidia-ml-py: pip install nvidia-ml-py") from None
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as e:
        raise ConfigError(f"NVML could not start: {e}") from None
    try:
        count = pynvml.nvmlDeviceGetCount()
        if count == 0:
            raise ConfigError("NVML found no GPUs on this machine")
        handles = [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        bus = {str(_text(pynvml.nvmlDeviceGetPciInfo(h).busId)).lower(): i for i, h in enumerate(handles)}
        name = str(_text(pynvml.nvmlDeviceGetName(handles[0])))
        memory = pynvml.nvmlDeviceGetMemoryInfo(handles[0]).total / 2**30
        parent = list(range(count + 1))  # the extra slot stands for an NVSwitch fabric

        def root(x):
            while parent[x] != x:
                parent[x] = parent[parent[x]]
                x = parent[x]
            return x

        links_per_gpu = []
        for i, h in enumerate(handles):
            active = 0
            for link in range(pynvml.NVML_NVLINK_MAX_LINKS):
                try:
                    if pynvml.nvmlDeviceGetNvLinkState(h, link) != pynvml.NVML_FEATURE_ENABLED:
                        continue
                    remote = str(_text(pynvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)).lower()
                except pynvml.NVMLError:
                    continue  # link not present on this GPU
                active += 1
                peer = bus.get(remote, count)  # not a GPU: an NVSwitch
                parent[root(i)] = root(peer)
            links_per_gpu.append(active)
    finally:
        pynvml.nvmlShutdown()
    groups: dict[int, list[int]] = {}
    for i in range(count):
        groups.setdefault(root(i), []).append(i)
    islands = sorted(groups.values())
    nv = NVLINK_GB_S_PER_LINK * min(links_per_gpu) if any(links_per_gpu) else 0.0
    spec = gpu_spec_for(name, memory)
    return _build("nvml", islands, spec, nv, nodes, _network_guess(all(links_per_gpu)),
                  notes="NVML; network guessed")


def _text(x):
    return x.decode() if isinstance(x, bytes) else x


def topology_from_ray(*, preset: str | None = None, address: str = "auto") -> Topology:
    """Nodes and GPUs per node from a running Ray cluster; link figures from `preset`
    (or the preset matching the GPU type Ray reports, else dgx-h100's)."""
    try:
        import ray
    except ImportError:
        raise ConfigError("Ray discovery needs ray: pip install 'atoll[ray]'") from None
    if not ray.is_initialized():
        try:
            ray.init(address=address, log_to_driver=False)
        except ConnectionError as e:
            raise ConfigError(f"no running Ray cluster at {address}: {e}") from None
    alive = [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get("GPU", 0) > 0]
    if not alive:
        raise ConfigError("the Ray cluster has no alive node with GPUs")
    counts = sorted({int(n["Resources"]["GPU"]) for n in alive})
    if len(counts) > 1:
        raise ConfigError(f"Ray nodes have different GPU counts {counts}; describe them in a YAML file")
    kinds = [k for n in alive for k in n["Resources"] if k.startswith("accelerator_type:")]
    base = preset or (preset_for_gpu(kinds[0].split(":", 1)[1]) if kinds else None) or "dgx-h100"
    d = yaml.safe_load((PRESET_DIR / f"{base}.yaml").read_text())
    gpn = counts[0]
    isl = d.get("islands", 1)
    d.update(name=f"ray({base})", gpus_per_node=gpn, node_names=[n["NodeManagerAddress"] for n in alive],
             islands=min(isl, gpn) if isinstance(isl, int) and gpn % min(isl, gpn) == 0 else 1)
    return topology_from_dict(d, nodes=len(alive), where="ray cluster")


def discover(*, nodes: int = 1) -> Topology:
    """NVML if it answers, else `nvidia-smi topo -m`, else this machine's CPU ranks."""
    try:
        return topology_from_nvml(nodes=nodes)
    except ConfigError:
        pass
    smi = shutil.which("nvidia-smi")
    if smi:
        try:
            out = subprocess.run([smi, "topo", "-m"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0:
                return topology_from_smi(out.stdout, nodes=nodes)
        except (OSError, subprocess.TimeoutExpired, ConfigError):
            pass
    return load_topology("local", nodes=nodes)
