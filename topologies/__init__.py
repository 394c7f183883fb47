"""Cluster topologies: presets, YAML files and live discovery (NVML, nvidia-smi, Ray)."""

from atoll.topologies.discover import discover, topology_from_nvml, topology_from_ray, topology_from_smi
from atoll.topologies.load import load_topology, preset_names, topology_from_dict
from atoll.topologies.schema import GpuSpec, Link, Node, Topology

__all__ = ["GpuSpec", "Link", "Node", "Topology", "discover", "load_topology", "preset_names",
           "topology_from_dict", "topology_from_nvml", "topology_from_ray", "topology_from_smi"]
