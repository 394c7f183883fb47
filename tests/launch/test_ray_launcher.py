"""The Ray launcher on a simulated cluster: a driver node with no resources and two nodes
with two fake GPUs each (conftest's `cluster`: ray.cluster_utils.Cluster, everything on
127.0.0.1)."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray", reason="the Ray launcher tests need `pip install ray`")

from launch_fns import collective, device_report, die_on_rank, free_gpus_back, raise_on_rank  # noqa: E402

from atoll.errors import LaunchError, RankFailure  # noqa: E402
from atoll.launch.device import DeviceError  # noqa: E402
from atoll.launch.ray_cluster import node_groups  # noqa: E402
from atoll.launch.ray_launcher import gpu_index, run_ray  # noqa: E402

from paths import TESTS as HERE  # noqa: E402  (ray_script.py)
pytestmark = pytest.mark.timeout(300)


def _alive(pid: int) -> bool:
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_node_groups():
    assert node_groups(4, ranks_per_node=2) == [[0, 1], [2, 3]]
    assert node_groups(5, ranks_per_node=2) == [[0, 1], [2, 3], [4]]
    assert node_groups(3) == [[0, 1, 2]]

    class Interleaved:  # a placement-like object: node_of(rank)
        def node_of(self, rank):
            return f"n{rank % 2}"

    assert node_groups(4, Interleaved()) == [[0, 2], [1, 3]]


def test_gpu_index():
    """Ray's assigned id -> CUDA index among the devices the actor sees (all its node's)."""
    assert gpu_index([1], None) == 1  # no CUDA_VISIBLE_DEVICES: Ray's ids index the node's GPUs
    assert gpu_index(["1"], None) == 1
    assert gpu_index(["6"], "4,5,6,7") == 2  # Ray's ids are the node's CUDA_VISIBLE_DEVICES entries
    assert gpu_index(["GPU-b2c"], "GPU-a1f, GPU-b2c") == 1
    with pytest.raises(DeviceError, match="does not list it"):
        gpu_index(["3"], "0,1")
    with pytest.raises(DeviceError, match="one GPU, got none"):
        gpu_index([], None)
    with pytest.raises(DeviceError, match=r"one GPU, got \['0', '1'\]"):
        gpu_index([0, 1], None)


@pytest.mark.slow
def test_two_nodes_each_tp_pair_on_one_node(cluster):
    out = run_ray(collective, 4, device="auto", timeout_s=180)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    for o in out:
        assert o["sum"] == 1 + 2 + 3 + 4
        assert o["gathered"] == [[0.0, 0.0], [1.0, 1.0], [2.0, 4.0], [3.0, 9.0]]
        assert o["backend"] == "gloo"  # fake GPUs: no CUDA here
    nodes = [o["node"] for o in out]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3], nodes
    assert nodes[0] != nodes[2], nodes
    assert set(nodes) == set(cluster.gpu_nodes)  # nothing on the driver's GPU-less node
    assert free_gpus_back() == 4


@pytest.mark.slow
def test_auto_reserves_a_gpu_per_rank_and_each_sees_its_node(cluster):
    """The cluster has 4 (fake) GPUs for 4 ranks, so auto reserves one per rank's actor; each
    actor still sees all of its node's GPUs and computes on the one Ray assigned it. torch
    here has no CUDA, so auto settles on cpu + gloo everywhere."""
    assert ray.get_gpu_ids() == []  # the driver holds none
    out = run_ray(device_report, 4, device="auto", timeout_s=180)
    assert [o["rank"] for o in out] == [0, 1, 2, 3]
    nodes = [o["node"] for o in out]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2], nodes
    assert set(nodes) == set(cluster.gpu_nodes)
    for o in out:
        assert o["assigned"].get("GPU") == 1 and len(o["gpu_ids"]) == 1, o
        assert o["gpu_index"] == o["gpu_ids"][0], o  # no CUDA_VISIBLE_DEVICES on the node
        # not narrowed to the actor's own GPU: the node's value (here: unset) is left alone
        assert o["cuda_visible_devices"] == os.environ.get("CUDA_VISIBLE_DEVICES"), o
        assert (o["device"], o["backend"]) == ("cpu", "gloo"), o
    for a, b in ((0, 1), (2, 3)):  # the two ranks of a node on distinct GPUs of it
        assert {out[a]["gpu_index"], out[b]["gpu_index"]} == {"0", "1"}, out
    # during the run: 4 bundles of one GPU each hold every GPU of the cluster, the driver none
    assert sorted(out[0]["bundles"], key=str) == [{"CPU": 1.0, "GPU": 1.0}] * 4, out[0]["bundles"]
    assert out[0]["free_gpus"] == 0
    assert free_gpus_back() == 4


@pytest.mark.slow
def test_cpu_reserves_no_gpu(cluster):
    out = run_ray(device_report, 4, device="cpu", timeout_s=180)
    nodes = [o["node"] for o in out]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2], nodes
    for o in out:
        assert o["gpu_ids"] == [] and "GPU" not in o["assigned"] and o["gpu_index"] is None, o
        assert (o["device"], o["backend"]) == ("cpu", "gloo"), o
    assert out[0]["bundles"] == [{"CPU": 1.0}] * 4, out[0]["bundles"]
    assert out[0]["free_gpus"] == 4


@pytest.mark.slow
def test_cuda_without_cuda_torch_is_one_line(cluster):
    """The fake GPUs are reserved, but torch in the actors sees no CUDA device."""
    with pytest.raises(RankFailure) as info:
        run_ray(device_report, 4, device="cuda", timeout_s=180)
    assert str(info.value).startswith(f"rank {info.value.rank} on 127.0.0.1 (node ")
    assert "--device cuda but this rank sees no GPU" in info.value.cause, info.value.cause
    assert "\n" not in str(info.value)
    assert free_gpus_back() == 4


@pytest.mark.slow
def test_placement_object_decides_the_nodes(cluster):
    class Interleaved:
        def node_of(self, rank):
            return rank % 2

    out = run_ray(collective, 4, device="auto", placement=Interleaved(), timeout_s=180)
    nodes = [o["node"] for o in out]
    assert nodes[0] == nodes[2] and nodes[1] == nodes[3] and nodes[0] != nodes[1], nodes
    assert all(o["sum"] == 10 for o in out)


def _assert_prompt_failure(tmp_path, exc: RankFailure, rank: int):
    failed_at = float((tmp_path / "failed-at").read_text())
    took = time.time() - failed_at
    assert exc.rank == rank
    assert exc.node and "127.0.0.1" in exc.node, exc.node
    assert "\n" not in str(exc)
    assert took < 15, f"the job took {took:.1f}s to end after rank {rank} failed"
    pids = [int(p.name[4:]) for p in tmp_path.glob("pid-*")]
    assert len(pids) == 4, pids
    end = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < end:
        time.sleep(0.2)
    assert not [p for p in pids if _alive(p)], "a rank's actor outlived the job"
    assert free_gpus_back() == 4


def test_a_rank_that_raises_ends_the_job(cluster, tmp_path):
    with pytest.raises(RankFailure) as info:
        run_ray(raise_on_rank, 4, 1, str(tmp_path), device="auto", timeout_s=180)
    assert info.value.cause == "ValueError: bad input on rank 1"
    assert str(info.value).startswith("rank 1 on 127.0.0.1 (node ")
    _assert_prompt_failure(tmp_path, info.value, 1)


@pytest.mark.slow
def test_a_killed_actor_ends_the_job(cluster, tmp_path):
    with pytest.raises(RankFailure) as info:
        run_ray(die_on_rank, 4, 3, str(tmp_path), device="auto", timeout_s=180)
    assert "died" in info.value.cause, info.value.cause
    _assert_prompt_failure(tmp_path, info.value, 3)


def test_more_gpus_than_the_cluster_has(cluster):
    start = time.monotonic()
    with pytest.raises(LaunchError) as info:
        run_ray(collective, 6, device="cuda")
    assert str(info.value) == "6 ranks need 6 GPUs but the Ray cluster has 4"
    with pytest.raises(LaunchError) as info:
        run_ray(collective, 4, device="cuda", ranks_per_node=4)
    assert str(info.value) == "ranks 0-3 must share one node and need 4 GPUs, but the largest Ray node has 2"
    assert time.monotonic() - start < 10


def test_placement_that_never_fits_times_out(cluster):
    """Enough GPUs in total, but one GPU on each node is taken: a 2-GPU group never fits."""
    from ray.util.placement_group import placement_group, remove_placement_group

    hog = placement_group([{"GPU": 1}, {"GPU": 1}], strategy="STRICT_SPREAD")
    ray.get(hog.ready(), timeout=30)
    try:
        start = time.monotonic()
        with pytest.raises(LaunchError) as info:
            run_ray(collective, 2, device="cuda", ranks_per_node=2, ready_timeout_s=3)
        took = time.monotonic() - start
        assert "Ray could not place 1 node group(s)" in str(info.value)
        assert "'GPU': 2.0" in str(info.value)  # what is free now
        assert took < 15
    finally:
        remove_placement_group(hog)
    assert free_gpus_back() == 4  # the launcher released its partial reservation


def test_unknown_device_fails_before_ray_starts(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # not even imported
    with pytest.raises(DeviceError) as info:
        run_ray(collective, 2, device="gpu")
    assert str(info.value) == "device 'gpu' is not one of auto, cuda, cpu"


def test_ray_not_installed(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # import ray -> ImportError
    with pytest.raises(LaunchError) as info:
        run_ray(collective, 2)
    assert str(info.value) == "the Ray launcher needs Ray: pip install 'atoll[ray]'"


def _script(*args, timeout=240):
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("RAY_ADDRESS", None)
    proc = subprocess.run([sys.executable, str(HERE / "ray_script.py"), *args], capture_output=True,
                          text=True, timeout=timeout, env=env)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("{")]
    assert lines, proc.stdout + proc.stderr
    return proc.returncode, json.loads(lines[-1]), proc.stderr


def test_unreachable_address_is_one_line():
    import socket

    with socket.socket() as s:  # a port on this machine that nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    start = time.monotonic()
    rc, out, err = _script("address", f"127.0.0.1:{port}", timeout=60)
    assert rc == 2, err
    assert out == {"error": f"cannot reach the Ray cluster at 127.0.0.1:{port}: Connection refused"}
    assert time.monotonic() - start < 30


@pytest.mark.skipif(not Path("/proc/net/tcp").exists(), reason="reads listening sockets from /proc")
def test_local_mode_listens_on_loopback_only():
    """No address: run_ray starts Ray on this machine; Ray's servers, the workers and the
    rendezvous store all listen on 127.0.0.1 only."""
    rc, out, err = _script("local")
    assert rc == 0, err
    addrs = out["ok"]
    assert len(addrs) >= 4, addrs  # GCS, raylet, workers and the store at least
    wide = [a for a in addrs if not a.rsplit(":", 1)[0] in ("127.0.0.1", "::ffff:127.0.0.1", "::1")]
    assert not wide, f"listening beyond loopback: {wide}"


def test_fn_the_cluster_cannot_import(cluster, tmp_path, monkeypatch):
    """The driver can import fn's module but the cluster's workers cannot."""
    (tmp_path / "only_on_driver.py").write_text("def fn(rank, world_size):\n    return rank\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    from only_on_driver import fn

    with pytest.raises(RankFailure) as info:
        run_ray(fn, 2, timeout_s=120)
    assert "No module named 'only_on_driver'" in info.value.cause, info.value.cause
    assert "\n" not in str(info.value)


@pytest.mark.slow
def test_generate_tp2pp2_across_two_nodes_matches_local(cluster, tiny_model):
    """The engine's worker through Ray: each TP pair on one node, the two pipeline stages on
    different nodes, the same greedy tokens as the local launcher."""
    from gen_common import generate_requests, local_tokens, tokens
    from launch_fns import generate_where

    model = tiny_model("llama", num_hidden_layers=4)
    spec, requests = generate_requests(model)
    out = run_ray(generate_where, 4, spec, requests, device="auto", timeout_s=240)
    nodes = [node for node, _ in out]
    assert nodes[0] == nodes[1] and nodes[2] == nodes[3] and nodes[0] != nodes[2], nodes
    assert [res is None for _, res in out] == [False, True, True, True]
    got = tokens(out[0][1])
    assert all(len(t) == 8 for t in got), got
    assert got == local_tokens(model)


@pytest.mark.slow
def test_living_engine_tp2pp2_across_two_nodes_matches_local(cluster, tiny_model):
    """atoll.LLM on RayLauncher keeps its ranks (a RayJob running engine/rank/loop.py)
    between calls: the local launcher's tokens, twice from one engine; closing it frees every
    GPU it held."""
    from gen_common import PROMPTS, local_tokens

    from atoll.engine.sample.sampler import SamplingParams
    from atoll.launch.api import LLM, RayLauncher

    model = tiny_model("llama", num_hidden_layers=4)
    with LLM(model, layout="TP2PP2", launcher=RayLauncher(tp_size=2)) as llm:
        params = SamplingParams(max_tokens=8, ignore_eos=True)
        got = [o.token_ids for o in llm.generate(PROMPTS, params)]
        engine = llm.start()
        again = llm.generate(PROMPTS[:1], params)[0].token_ids
        assert llm.start() is engine  # the same ranks served both calls
    assert got == local_tokens(model)
    assert again == got[0]
    assert free_gpus_back() == 4


@pytest.mark.parametrize("layout", [pytest.param(["-tp", "2", "-pp", "2"], marks=pytest.mark.slow),
                                    ["--prefill", "TP2", "--decode", "TP2", "--disagg-min-prompt-tokens", "1"]],
                         ids=["TP2PP2", "disaggregated"])
@pytest.mark.slow
def test_generate_cli_on_ray_writes_each_result_as_it_ends(cluster, tiny_model, tmp_path, layout):
    """`atoll generate --launcher ray` writes a request's line as it finishes: the short
    request (second in the file) is in the output alone while the long one still runs; also
    with a TP2 prefill engine and a TP2 decode engine (every prompt prefilled remotely)."""
    import signal
    import threading

    from atoll.cli.main import main

    model = tiny_model("llama", num_hidden_layers=4)
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text(json.dumps({"id": "long", "prompt_token_ids": [5, 7, 9], "max_tokens": 64}) + "\n"
                       + json.dumps({"id": "short", "prompt_token_ids": [100, 3], "max_tokens": 2}) + "\n")
    seen: dict[tuple, float] = {}  # the ids in the file -> when first seen
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            try:
                lines = out.read_text().splitlines()
                seen.setdefault(tuple(json.loads(ln)["id"] for ln in lines), time.monotonic())
            except (OSError, ValueError):  # not there yet, or a line half written
                pass
            time.sleep(0.02)

    watcher = threading.Thread(target=watch, daemon=True)
    sigterm = signal.getsignal(signal.SIGTERM)
    watcher.start()
    try:
        with pytest.raises(SystemExit) as info:
            main(["generate", "--model", str(model), "--prompts", str(prompts), "--output", str(out),
                  "--launcher", "ray", *layout, "--no-progress"])
    finally:
        ended = time.monotonic()
        stop.set()
        watcher.join()
        signal.signal(signal.SIGTERM, sigterm)
    assert info.value.code == 0
    rows = [json.loads(ln) for ln in out.read_text().splitlines()]
    assert [r["id"] for r in rows] == ["long", "short"]  # input order once the run ended
    assert [len(r["token_ids"]) for r in rows] == [64, 2], rows
    assert ("short",) in seen, seen  # written while the long request still ran
    assert ended - seen[("short",)] > 0.5, (ended - seen[("short",)], seen)
    assert free_gpus_back() == 4
