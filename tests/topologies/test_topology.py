"""Topology schema, YAML presets and files, discovery through fake NVML and Ray modules."""

import sys
import types

import pytest

from atoll.errors import ConfigError
from atoll.topologies import GpuSpec, Link, Node, Topology, load_topology, preset_names
from atoll.topologies.discover import topology_from_nvml, topology_from_ray

PRESETS = ["a100-pcie", "a100-sxm", "dgx-b200", "dgx-h100", "dgx-h200", "gb200-nvl72", "hgx-h800",
           "l40s-pcie", "local"]

GOOD = """\
name: mini
gpus_per_node: 4
gpu: {name: X, memory_gib: 80, hbm_tb_s: 3, bf16_tflops: 900}
islands: 4
links:
  nvlink: {gb_s: 450, latency_us: 3}
  pcie: {gb_s: 64, latency_us: 5}
  network: {kind: infiniband, gb_s: 50, latency_us: 5}
"""


def write(tmp_path, text, name="t.yaml"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def test_every_named_preset_exists_and_loads():
    assert sorted(preset_names()) == PRESETS
    for name in PRESETS:
        t = load_topology(name)
        assert t.num_gpus == t.num_nodes * t.gpus_per_node


def test_data_sheet_figures():
    # H200 sheet: 4.8 TB/s, 989 bf16, NVLink 900 GB/s both ways; nvidia-smi: 143771 MiB
    h200 = load_topology("dgx-h200")
    assert h200.gpu.hbm_tb_s == 4.8 and h200.gpu.bf16_tflops == 989 and h200.gpu.fp8_tflops == 1979
    assert h200.island_link.gb_s * 2 == 900
    assert h200.gpu.memory_bytes == pytest.approx(143771 * 2**20, rel=1e-3)
    assert h200.network.gb_s * 8 == 400  # ConnectX-7 400 Gb/s per GPU
    assert load_topology("hgx-h800").island_link.gb_s * 2 == 400
    assert load_topology("a100-sxm").gpu.fp8_tflops == 0  # Ampere has no fp8 tensor cores
    assert load_topology("l40s-pcie").island_size == 1


def test_nodes_multiply_and_islands_stay_per_node():
    t = load_topology("dgx-h100", nodes=4)
    assert t.num_gpus == 32 and len(t.islands) == 4
    assert t.link_between((0, 0), (0, 7)).kind == "nvlink"
    assert t.link_between((0, 0), (1, 0)).kind == "infiniband"


def test_gb200_island_spans_trays():
    t = load_topology("gb200-nvl72")
    assert t.num_nodes == 18 and t.gpus_per_node == 4 and t.island_size == 72
    assert t.link_between((0, 0), (17, 3)).kind == "nvlink"
    two_racks = load_topology("gb200-nvl72", nodes=36)
    assert len(two_racks.islands) == 2 and two_racks.link_between((0, 0), (18, 0)).kind == "infiniband"
    with pytest.raises(ConfigError, match="do not split into islands of 72"):
        load_topology("gb200-nvl72", nodes=20)


def test_part_of_a_node_and_network_override():
    four = load_topology("dgx-h200", gpus_per_node=4)
    assert four.num_gpus == 4 and four.island_size == 4
    eth = load_topology("dgx-h100", nodes=2, network="ethernet:25")
    assert eth.network.kind == "ethernet" and eth.network.gb_s == 25 / 8 and eth.network.shared
    assert eth.network.per_gpu_gb_s(8) == pytest.approx(25 / 8 / 8)
    with pytest.raises(ConfigError, match="expected KIND:GBITS"):
        load_topology("dgx-h100", network="carrier-pigeon:1")


def test_yaml_file_with_explicit_island_lists(tmp_path):
    text = GOOD.replace("islands: 4", "islands: [[0, 1], [2, 3]]")
    t = load_topology(write(tmp_path, text), nodes=2)
    assert [len(i) for i in t.islands] == [2, 2, 2, 2]
    assert t.link_between((0, 1), (0, 2)).kind == "pcie"


@pytest.mark.parametrize("edit, message", [
    (("  network: {kind: infiniband, gb_s: 50, latency_us: 5}\n", ""), "missing field 'links.network'"),
    (("hbm_tb_s: 3, ", ""), "missing field 'gpu.hbm_tb_s'"),
    (("islands: 4", "islands: [[0, 1], [2]]"), "islands \\[\\[0, 1\\], \\[2\\]\\] cover 3 GPUs but gpus_per_node is 4"),
    (("islands: 4", "islands: 3"), "islands of 3 GPUs do not divide gpus_per_node=4"),
    (("gpus_per_node: 4", "gpus_per_node: 0"), "gpus_per_node=0 must be a positive integer"),
    (("kind: infiniband", "kind: smoke-signals"), "link kind 'smoke-signals' is not one of"),
    (("bf16_tflops: 900", "bf16_tflops: -1"), "bf16_tflops=-1 must be a positive number"),
])
def test_bad_yaml_gives_one_clear_line(tmp_path, edit, message):
    path = write(tmp_path, GOOD.replace(*edit))
    with pytest.raises(ConfigError, match=message) as e:
        load_topology(path)
    assert "\n" not in str(e.value)


def test_unknown_preset_lists_known_ones():
    with pytest.raises(ConfigError, match="known presets: a100-pcie, a100-sxm, dgx-b200"):
        load_topology("dgx-h300")


def test_nodes_below_one_rejected():
    with pytest.raises(ConfigError, match="nodes=0 must be at least 1"):
        load_topology("dgx-h100", nodes=0)


def test_topology_checks_islands_cover_every_gpu_once():
    gpu = GpuSpec("X", 80, 3, 900)
    link = Link("nvlink", 450, 3)
    nodes = (Node("a", 2, gpu),)
    with pytest.raises(ConfigError, match="islands cover 1 GPUs but the 1 node\\(s\\) have 2"):
        Topology("t", nodes, (((0, 0),),), link, link, link)
    with pytest.raises(ConfigError, match="GPU 0 of node 0 is in islands 0 and 1"):
        Topology("t", nodes, (((0, 0), (0, 1)), ((0, 0),)), link, link, link)


def _fake_nvml(links_per_gpu, switch=True, name="NVIDIA H100 80GB HBM3"):
    """A pynvml stand-in: every GPU's links go to an NVSwitch (or to GPU i^1 when not)."""
    m = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    m.NVMLError, m.NVML_NVLINK_MAX_LINKS, m.NVML_FEATURE_ENABLED = NVMLError, 18, 1
    count = len(links_per_gpu)
    m.nvmlInit = m.nvmlShutdown = lambda: None
    m.nvmlDeviceGetCount = lambda: count
    m.nvmlDeviceGetHandleByIndex = lambda i: i
    m.nvmlDeviceGetName = lambda h: name.encode()
    m.nvmlDeviceGetPciInfo = lambda h: types.SimpleNamespace(busId=f"0000:{h:02x}:00.0".encode())
    m.nvmlDeviceGetMemoryInfo = lambda h: types.SimpleNamespace(total=81559 * 2**20)

    def state(h, link):
        if link >= links_per_gpu[h]:
            raise NVMLError("not supported")
        return 1

    def remote(h, link):
        peer = f"0000:{0xf0 + link:02x}:00.0" if switch else f"0000:{h ^ 1:02x}:00.0"
        return types.SimpleNamespace(busId=peer.encode())

    m.nvmlDeviceGetNvLinkState, m.nvmlDeviceGetNvLinkRemotePciInfo = state, remote
    return m


def test_nvml_discovery_nvswitch_box(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([18] * 8))
    t = topology_from_nvml(nodes=2)
    assert t.num_gpus == 16 and t.island_size == 8
    assert t.island_link.gb_s == 18 * 25.0  # 450 GB/s each way, the H100 sheet's 900 bidirectional
    assert t.gpu.name == "H100-SXM" and t.gpu.memory_gib == pytest.approx(79.6, abs=0.05)


def test_nvml_discovery_pairs_and_no_nvlink(monkeypatch):
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([4] * 4, switch=False, name="NVIDIA A30"))
    t = topology_from_nvml()
    assert [len(i) for i in t.islands] == [2, 2] and "figures unknown" in t.gpu.name
    monkeypatch.setitem(sys.modules, "pynvml", _fake_nvml([0] * 4, name="NVIDIA L40S"))
    assert topology_from_nvml().island_size == 1


def test_ray_discovery(monkeypatch):
    ray = types.ModuleType("ray")
    ray.is_initialized = lambda: True
    ray.nodes = lambda: [
        {"Alive": True, "NodeManagerAddress": "10.0.0.1", "Resources": {"GPU": 8.0, "accelerator_type:H200": 1}},
        {"Alive": True, "NodeManagerAddress": "10.0.0.2", "Resources": {"GPU": 8.0}},
        {"Alive": False, "NodeManagerAddress": "10.0.0.3", "Resources": {"GPU": 8.0}},
        {"Alive": True, "NodeManagerAddress": "10.0.0.4", "Resources": {"CPU": 64.0}},  # driver, no GPU
    ]
    monkeypatch.setitem(sys.modules, "ray", ray)
    t = topology_from_ray()
    assert [n.name for n in t.nodes] == ["10.0.0.1", "10.0.0.2"] and t.gpu.name == "H200-SXM"
    assert t.island_size == 8
    ray.nodes = lambda: [{"Alive": True, "NodeManagerAddress": "a", "Resources": {"GPU": 8.0}},
                         {"Alive": True, "NodeManagerAddress": "b", "Resources": {"GPU": 4.0}}]
    with pytest.raises(ConfigError, match="different GPU counts \\[4, 8\\]"):
        topology_from_ray()
