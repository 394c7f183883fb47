"""The `nvidia-smi topo -m` parser on real outputs of real machine shapes (tests/data)."""


import pytest

from paths import DATA as TESTS_DATA

from atoll.errors import ConfigError
from atoll.topologies import topology_from_smi
from atoll.topologies.smi import parse_smi_topo

DATA = TESTS_DATA / "nvidia-smi-topo"


def read(name):
    return (DATA / name).read_text()


@pytest.mark.parametrize("name, gpus, islands", [
    ("dgx-h100-8gpu.txt", 8, [[0, 1, 2, 3, 4, 5, 6, 7]]),
    ("dgx-h100-8gpu-13nic-ib-eth.txt", 8, [list(range(8))]),
    ("h800-8gpu-gdr-nic-names-affinity-overflow.txt", 8, [list(range(8))]),
    ("h200-8gpu-slurm-cgroup-empty-cpu-affinity-unattributed.txt", 8, [list(range(8))]),
    ("h20-8gpu-non-mlx5-nic-names-unattributed.txt", 8, [list(range(8))]),
    ("gb200-4gpu-8nic-unattributed.txt", 4, [[0, 1, 2, 3]]),
    ("dgx1-v100-8gpu-hybrid-cube-mesh-old-format.txt", 8, [list(range(8))]),
    ("nvlink-pairs-8gpu-a6000.txt", 8, [[0, 1], [2, 3], [4, 5], [6, 7]]),
    ("nvlink-pairs-4gpu-a30.txt", 4, [[0, 1], [2, 3]]),
    ("pcie-4gpu-l40s.txt", 4, [[0], [1], [2], [3]]),
    ("pcie-8gpu-pix-pxb.txt", 8, [[g] for g in range(8)]),
    ("pcie-8gpu-rtx4090-tabs.txt", 8, [[g] for g in range(8)]),
    ("pcie-5gpu-mixed-numa.txt", 5, [[g] for g in range(5)]),
    ("two-gpu-rtx5090-phb-tabs.txt", 2, [[0], [1]]),
])
def test_islands_of_real_machines(name, gpus, islands):
    m = parse_smi_topo(read(name))
    assert len(m.gpus) == gpus
    assert m.islands() == islands


def test_nvswitch_box_cells_and_nics():
    m = parse_smi_topo(read("dgx-h100-8gpu.txt"))
    assert m.nvlinks(0, 7) == 18 and m.gpu_link(3, 3) == "X"
    assert m.nics == tuple(f"mlx5_{i}" for i in range(8))  # from the NIC Legend
    assert [m.near_nics(g) for g in range(8)] == [[f"mlx5_{g}"] for g in range(8)]
    assert not m.truncated


def test_nic_names_from_legend_and_old_header():
    assert parse_smi_topo(read("dgx-h100-8gpu-13nic-ib-eth.txt")).nics[8] == "mlx5_eth0"
    assert parse_smi_topo(read("h20-8gpu-non-mlx5-nic-names-unattributed.txt")).nics[4] == "rocep32s0f0"
    old = parse_smi_topo(read("dgx1-v100-8gpu-hybrid-cube-mesh-old-format.txt"))
    assert old.nics == ("mlx5_0", "mlx5_1", "mlx5_2", "mlx5_3")
    assert old.gpu_link(0, 5) == "SYS" and old.nvlinks(0, 3) == 2 and old.nvlinks(0, 1) == 1


def test_glued_and_empty_affinity_columns_do_not_shift_cells():
    h800 = parse_smi_topo(read("h800-8gpu-gdr-nic-names-affinity-overflow.txt"))
    assert h800.cells[("GPU0", "NIC9")] == "PXB" and h800.near_nics(7) == ["mlx5_gdr_7"]
    h200 = parse_smi_topo(read("h200-8gpu-slurm-cgroup-empty-cpu-affinity-unattributed.txt"))
    assert h200.near_nics(1) == ["mlx5_3"] and h200.near_nics(7) == ["mlx5_9"]


def test_tab_separated_without_legend():
    m = parse_smi_topo(read("pcie-8gpu-rtx4090-tabs.txt"))
    assert m.cells[("GPU6", "NIC0")] == "PHB" and m.nics == ("NIC0", "NIC1")


def test_truncated_nic_cells_are_flagged_but_gpu_matrix_kept():
    m = parse_smi_topo(read("gb200-4gpu-sglang-11208-partial.txt"))
    assert m.truncated and m.islands() == [[0, 1, 2, 3]]


def test_cut_inside_gpu_block_is_an_error():
    text = read("dgx-h100-8gpu.txt").splitlines()
    cut = "\n".join(text[:6] + [text[6][:30]])  # GPU3's row stops after three cells
    with pytest.raises(ConfigError, match="GPU3 has 3 of 8 GPU cells"):
        parse_smi_topo(cut)


def test_no_header_is_an_error():
    with pytest.raises(ConfigError, match="no `nvidia-smi topo -m` header"):
        parse_smi_topo("Failed to initialize NVML: Driver/library version mismatch\n")


def test_asymmetric_matrix_is_an_error():
    text = read("nvlink-pairs-4gpu-a30.txt").replace("GPU1    NV4      X", "GPU1    SYS      X")
    with pytest.raises(ConfigError, match="GPU0->GPU1 is NV4 but GPU1->GPU0 is SYS"):
        parse_smi_topo(text)


def test_topology_from_smi_builds_islands_and_links():
    t = topology_from_smi(read("nvlink-pairs-8gpu-a6000.txt"), nodes=2)
    assert t.num_gpus == 16 and len(t.islands) == 8 and t.island_size == 2
    assert t.island_link.kind == "nvlink" and t.island_link.gb_s == 4 * 25.0
    assert t.network.shared  # two NICs for eight GPUs: not one per GPU
    dgx = topology_from_smi(read("dgx-h100-8gpu.txt"))
    assert dgx.island_size == 8 and not dgx.network.shared and dgx.network.kind == "infiniband"
    pcie = topology_from_smi(read("pcie-4gpu-l40s.txt"))
    assert pcie.island_size == 1 and pcie.island_link.kind == "pcie"
