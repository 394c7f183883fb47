"""The Ray launcher places the ranks where a plan says (launch.ray_placement): the node
matching (by name, or in the plan's order), the GPU each rank runs on, one line where Ray's
GPUs differ; without a plan, whole TP groups per node. The placement rules run without Ray;
the runs use conftest's simulated cluster (2 nodes x 2 CPUs, 2 fake GPUs)."""

import json
from pathlib import Path

import pytest
import yaml
from cli import run_cli

from atoll.errors import LaunchError
from atoll.launch.ray_placement import RayNode, match_gpus, pack_tp_groups, plan_nodes
from atoll.parallel.layout import Layout
from atoll.parallel.placement import Placement

pytestmark = pytest.mark.timeout(300)
CPU = {"CPU": 1}
GPU = {"CPU": 1, "GPU": 1}

# a request mix that fits the tiny models' 256-token context (the planner refuses one that does not)
FITS = ("--isl", "64", "--osl", "16")


def _nodes(*sizes, address="10.0.0.{}", gpus=True):
    return [RayNode(f"{i:02x}" * 28, address.format(i + 1), f"host{i + 1}.lan",
                    {"CPU": float(n), **({"GPU": float(n)} if gpus else {})}) for i, n in enumerate(sizes)]


def test_whole_tp_groups_per_node_without_a_plan():
    # TP2PP2 on two nodes of 2: one stage per node (the refused case)
    assert pack_tp_groups(4, 2, _nodes(2, 2, gpus=False), CPU) == [[0, 1], [2, 3]]
    # nodes of 3: chunks of 3 would split the TP group 2-3; whole TP groups keep it
    assert pack_tp_groups(4, 2, _nodes(3, 3), GPU) == [[0, 1], [2, 3]]
    # largest node first; a stage may go on on the next node
    assert pack_tp_groups(8, 2, _nodes(2, 4, 2), GPU) == [[0, 1, 2, 3], [4, 5], [6, 7]]
    assert pack_tp_groups(4, 1, _nodes(0, 2, 2), GPU) == [[0, 1], [2, 3]]  # a driver node without GPUs
    with pytest.raises(LaunchError) as e:
        pack_tp_groups(4, 4, _nodes(2, 2), GPU)
    assert str(e.value) == "a TP group of 4 ranks must share one node and needs 4 GPUs, but the largest Ray node has 2"
    with pytest.raises(LaunchError) as e:
        pack_tp_groups(6, 2, _nodes(3, 3), GPU)
    assert str(e.value) == "the Ray nodes hold 4 of 6 ranks in whole TP groups of 2 (ranks per node: 3, 3)"


def _placement(names, slots, layout="TP2PP2"):
    return Placement(Layout.parse(layout), tuple(slots), tuple(names), tuple(n for n, _ in slots))


def test_plan_nodes_by_name_or_in_order():
    nodes = _nodes(2, 2, 2)
    slots = [(0, 0), (0, 1), (1, 0), (1, 1)]
    # preset names: the plan's order over the nodes that hold its ranks
    got = plan_nodes(_placement(("node0", "node1"), slots), 4, nodes, GPU)
    assert [(n.address, r) for n, r in got] == [("10.0.0.1", [0, 1]), ("10.0.0.2", [2, 3])]
    small = _nodes(1, 2, 2)
    assert [n.address for n, _ in plan_nodes(_placement(("node0", "node1"), slots), 4, small, GPU)] == \
        ["10.0.0.2", "10.0.0.3"]
    # names Ray knows: IP, host name (or its first label), node id or 8+ of its first hex digits
    for names in (("10.0.0.3", "10.0.0.1"), ("host3", "host1.lan"), (nodes[2].id, nodes[0].id[:8])):
        got = plan_nodes(_placement(names, slots), 4, nodes, GPU)
        assert [(n.address, r) for n, r in got] == [("10.0.0.3", [0, 1]), ("10.0.0.1", [2, 3])], names
    with pytest.raises(LaunchError, match=r"^the plan's node 10.0.0.9 is none of the Ray cluster's nodes"):
        plan_nodes(_placement(("10.0.0.1", "10.0.0.9"), slots), 4, nodes, GPU)
    twins = _nodes(2, 2, address="127.0.0.1")
    with pytest.raises(LaunchError, match=r"^the plan's node 127.0.0.1 matches 2 Ray nodes .*; name it by Ray node "):
        plan_nodes(_placement(("127.0.0.1", twins[1].id), slots), 4, twins, GPU)
    with pytest.raises(LaunchError, match=r"^the plan puts ranks 0-1 on 10.0.0.1, but Ray node 10.0.0.1 \(node "):
        plan_nodes(_placement(("10.0.0.1", "10.0.0.2"), slots), 4, _nodes(1, 2), GPU)
    with pytest.raises(LaunchError) as e:
        plan_nodes(_placement(("node0", "node1"), slots), 4, _nodes(2, 1), GPU)
    assert str(e.value) == ("no Ray node is left with room for the plan's node1 (ranks 2-3) after 1 other planned "
                            "node(s); ranks each Ray node holds: 10.0.0.1 (node 00000000): 2, 10.0.0.2 (node 01010101): 1")


def test_each_rank_takes_the_actor_holding_its_planned_gpu():
    assert match_gpus({0: 1, 1: 0}, [0, 1]) == {0: 1, 1: 0}
    assert match_gpus({2: 0, 3: 1}, [1, 3]) == {3: 0, 2: 1}  # GPU 0 is another job's: rank 2 takes GPU 3
    assert match_gpus({0: None, 1: None}, [None, None]) == {0: 0, 1: 1}  # CPU ranks: in order


# ---- on the simulated cluster ---------------------------------------------------------------


def _first_in_order(cluster):
    """The plan's node0 and node1 in order: the GPU nodes by address, then id (all 127.0.0.1)."""
    return sorted(cluster.gpu_nodes)


@pytest.mark.slow
def test_a_saved_plan_drives_two_ray_nodes(cluster, capsys, tiny_model, tmp_path):
    from launch_fns import device_report

    from atoll.launch.ray_launcher import run_ray
    from atoll.planner.planfile import load_plan, plan_yaml

    path = tmp_path / "plan.yaml"
    code, _, err = run_cli(capsys, "plan", *FITS, "--model", str(tiny_model("llama")), "--topology", "dgx-h200",
                           "--nodes", "2", "--gpus-per-node", "2", "--layouts", "TP2PP2", "--save", str(path))
    assert code == 0, err
    saved = load_plan(path)
    assert plan_yaml(saved) == path.read_text()  # written as read
    p = saved.placement
    assert p.slots == ((0, 0), (0, 1), (1, 0), (1, 1)) and p.node_names == ("node0", "node1")
    out = run_ray(device_report, 4, placement=p, device="auto", timeout_s=120)
    ray_node = _first_in_order(cluster)
    for r, o in enumerate(out):
        assert o["node"] == ray_node[p.node_of(r)], (r, o["node"])
        assert int(o["gpu_index"]) == p.gpu_of(r), (r, o)
    err = capsys.readouterr().err
    assert f"the plan's nodes on Ray: node0 -> 127.0.0.1 (node {ray_node[0][:8]}), " \
           f"node1 -> 127.0.0.1 (node {ray_node[1][:8]})" in err
    assert "differ from the plan" not in err


@pytest.mark.slow
def test_a_plan_naming_ray_nodes_pins_nodes_and_gpus(cluster, capsys, tiny_model, tmp_path):
    """A plan file whose nodes are Ray node ids, ranks 0-1 on the second with their GPUs swapped."""
    from launch_fns import device_report

    from atoll.launch.ray_launcher import run_ray
    from atoll.planner.planfile import load_plan

    base = tmp_path / "base.yaml"
    code, _, err = run_cli(capsys, "plan", *FITS, "--model", str(tiny_model("llama")), "--topology", "dgx-h200",
                           "--nodes", "2", "--gpus-per-node", "2", "--layouts", "TP2PP2", "--save", str(base))
    assert code == 0, err
    first, second = cluster.gpu_nodes[1], cluster.gpu_nodes[0]
    d = yaml.safe_load(base.read_text())
    d["topology"]["node_names"] = [first, second]
    d["placement"] = [{"rank": 0, "node": first, "gpu": 1}, {"rank": 1, "node": first, "gpu": 0},
                      {"rank": 2, "node": second, "gpu": 0}, {"rank": 3, "node": second, "gpu": 1}]
    path = tmp_path / "named.yaml"
    path.write_text(yaml.safe_dump(d))
    p = load_plan(path).placement
    out = run_ray(device_report, 4, placement=p, device="auto", timeout_s=120)
    assert [(o["node"], o["gpu_index"]) for o in out] == [(first, "1"), (first, "0"), (second, "0"), (second, "1")]
    assert "differ from the plan" not in capsys.readouterr().err


def test_gpus_ray_holds_elsewhere_are_one_line_or_refused(cluster, capsys):
    """Another job holds the planned GPU: the rank runs on the one Ray gives, with one warning
    line; --strict-placement refuses before any rank runs."""
    import ray
    from launch_fns import device_report
    from ray.util.placement_group import placement_group, remove_placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from atoll.launch.ray_launcher import run_ray

    node = cluster.gpu_nodes[0]
    hog = placement_group([{"GPU": 1}], strategy="STRICT_PACK", bundle_label_selector=[{"ray.io/node-id": node}])
    ray.get(hog.ready(), timeout=30)
    try:
        held = ray.get(ray.remote(lambda: ray.get_gpu_ids()).options(
            num_gpus=1, num_cpus=0, scheduling_strategy=PlacementGroupSchedulingStrategy(hog)).remote(), timeout=60)
        taken = int(held[0])
        p = _placement((node, cluster.gpu_nodes[1]), [(0, taken), (1, 0)], layout="PP2")
        out = run_ray(device_report, 2, placement=p, device="auto", timeout_s=120)
        assert out[0]["node"] == node and int(out[0]["gpu_index"]) == 1 - taken
        err = capsys.readouterr().err
        assert f"atoll: warning: the job's ranks differ from the plan: rank 0 on GPU {1 - taken} " \
               f"(plan: GPU {taken})\n" in err
        with pytest.raises(LaunchError) as e:
            run_ray(device_report, 2, placement=p, device="auto", timeout_s=120, strict_placement=True)
        assert str(e.value) == (f"the job's ranks differ from the plan: rank 0 on GPU {1 - taken} (plan: GPU {taken}) "
                                "(--strict-placement)")
    finally:
        remove_placement_group(hog)


@pytest.mark.slow
def test_generate_tp2pp2_on_two_cpu_nodes_with_stats(cluster, capsys, tiny_model, tmp_path):
    """No plan, CPU ranks, nodes of 2 CPUs: each TP pair on one node, a stage per node, the
    local tokens; --stats: TP inside a node (island links), the pipeline across (network)."""
    from gen_common import PROMPTS, local_tokens

    model = tiny_model("llama", num_hidden_layers=4)
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt_token_ids": p}) + "\n" for i, p in enumerate(PROMPTS)))
    out = tmp_path / "out.jsonl"
    code, _, err = run_cli(capsys, "generate", "--model", str(model), "-tp", "2", "-pp", "2", "--launcher", "ray",
                           "--device", "cpu", "--prompts", str(prompts), "--max-new-tokens", "8", "--output", str(out),
                           "--no-progress", "--stats", "--enforce-eager")
    assert code == 0, err
    rows = {r["id"]: r["token_ids"] for r in map(json.loads, Path(out).read_text().splitlines())}
    assert [rows[i] for i in range(len(PROMPTS))] == local_tokens(model)
    stats = {ln.split()[1]: ln for ln in err.splitlines() if ln.startswith("atoll: ") and " links: " in ln}
    assert list(stats) == ["island", "node", "network"], err
    numbers = {k: [int(t.replace(",", "")) for t in v.replace("(", " ").split() if t.replace(",", "").isdigit()]
               for k, v in stats.items()}
    # [dispatch, rows, collectives, calls, ranks]: no MoE; TP's all_reduce on a node; PP's sends across
    assert numbers["island"][:2] == [0, 0] and numbers["island"][2] > 0
    assert numbers["node"][:4] == [0, 0, 0, 0]
    assert numbers["network"][2] > 0 and numbers["network"][4] == 4
