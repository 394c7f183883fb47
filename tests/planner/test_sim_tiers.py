"""The KV cache tiers in the planner and the simulator: capacity in tokens (planner/memory.py),
speeds from the topology or calibration (planner/tiers.py, calibrate/tiers.py) and the
scheduler's tier hooks on the simulated clock (planner/sim/tiers.py)."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import pytest
import yaml
from cli import run_cli

from atoll.calibrate import write_yaml
from atoll.calibrate.tiers import measure_tiers
from atoll.engine.kv.blocks import block_hash
from atoll.engine.kv.tiers.record import HEADER
from atoll.errors import ConfigError
from atoll.planner.sim.api import Deployment, simulate
from atoll.planner.sim.load import BenchRequest, multi_turn_requests, random_requests
from atoll.planner.sim.tiers import SimTiers, Store
from atoll.planner.tiers import TierSpeed, tier_speeds
from atoll.topologies import load_topology, topology_from_dict
from atoll.topologies.load import PRESET_DIR

MODEL = "Llama-3.1-8B"
BLOCK = 16 * 32 * 2 * 8 * 128 * 2  # Llama-3.1-8B, bf16, TP1: tokens x layers x (k, v) x kv heads x head dim x bytes


@pytest.fixture(scope="module")
def h200():
    return load_topology("dgx-h200")


@pytest.fixture(scope="module")
def chats():
    """24 conversations of 4 turns, 1024 tokens first, on a pool of 300 blocks (4,800 tokens:
    8 conversations in flight hold 8,000 to 11,000)."""
    return multi_turn_requests(24, turns=4, input_len=1024, user_len=64, output_len=32, vocab_size=32000, seed=0)


def _chat(topology, reqs, **tiers):
    d = Deployment(layout="TP1", max_num_seqs=8, prefix_caching=True, num_blocks=300, **tiers)
    return simulate(MODEL, topology, d, reqs, max_concurrency=8)


def _names(n: int) -> list[bytes]:
    out = []
    for i in range(n):
        out.append(block_hash(out[-1] if out else None, list(range(i * 16, i * 16 + 16))))
    return out


def test_a_conversations_turns_repeat_its_history_and_follow_each_other(chats):
    firsts, later = chats[:24], chats[24:]
    assert all(r.after is None and len(r.prompt) == 1024 for r in firsts)
    for r in later:  # the turn before it, its answer (32 stand-in tokens), 64 new ones
        before = chats[r.after]
        assert r.prompt[:len(before.prompt)] == before.prompt and len(r.prompt) == len(before.prompt) + 96
    out = simulate(MODEL, load_topology("dgx-h200"), Deployment(layout="TP1", prefix_caching=True), chats[:48],
                   max_concurrency=8)
    assert out["serve"]["completed"] == 48
    # a large pool keeps every history, the answers' blocks too (the stand-in answer is the one the
    # engine gave): a first turn computed 1024 + 31 positions, 65 full blocks; a second turn's
    # 1120 tokens compute all but those 1040 (were the answer another, 1024 would be found)
    assert out["engines"][0]["prompt_tokens_computed"] == 24 * 1024 + 24 * (1120 - 65 * 16)


def test_a_host_tier_cuts_the_prefill_and_the_later_turns_ttft(h200, chats):
    none = _chat(h200, chats)
    host = _chat(h200, chats, kv_offload_gb=8.0)
    assert none["serve"]["completed"] == host["serve"]["completed"] == len(chats)
    assert "kv_tiers" not in none and host["kv_tiers"]["tiers"]["host"]["hits"] > 1000
    before, after = none["engines"][0]["prompt_tokens_computed"], host["kv_tiers"]["prompt_tokens_computed"]
    assert after < 0.6 * before, (before, after)
    later = (none["turns_ttft_ms"]["later"]["p50"], host["turns_ttft_ms"]["later"]["p50"])
    assert later[1] < 0.8 * later[0], later
    # first turns have no history: the tier changes nothing for them
    assert host["turns_ttft_ms"]["first"]["p50"] == pytest.approx(none["turns_ttft_ms"]["first"]["p50"], rel=0.05)
    # the capacity reported: 8 GiB over records of a block and the engine's header
    held = host["kv_capacity"][0]["tokens"]
    assert held == {"device": 300 * 16, "host": math.floor(8 * 2**30 / (BLOCK + HEADER.size)) * 16}


def test_b_a_slower_tier_gives_a_longer_ttft(chats):
    d = yaml.safe_load((PRESET_DIR / "dgx-h200.yaml").read_text())
    runs = {bw: _chat(topology_from_dict(d | {"kv_tiers": {"host": {"read_gb_s": bw}}}), chats, kv_offload_gb=8.0)
            for bw in (0.5, 100.0)}
    slow, fast = (runs[bw]["turns_ttft_ms"]["later"]["p50"] for bw in (0.5, 100.0))
    assert slow > 3 * fast, (slow, fast)
    # per block read the slow tier spends about the bandwidths' ratio more (in series with PCIe)
    per = {bw: r["kv_tiers"]["tiers"]["host"]["fetch_s"] / r["kv_tiers"]["tiers"]["host"]["hits"]
           for bw, r in runs.items()}
    assert per[0.5] > 30 * per[100.0]


def test_b_a_read_takes_latency_plus_bytes_over_bandwidth_and_reads_queue():
    now = [0.0]
    speed = TierSpeed(read_bytes_s=1e9, write_bytes_s=1e10, latency_s=1e-4, source="test")
    store = Store("host", 4, speed, 1e6)  # 1 MB blocks, four of them at most
    tiers = SimTiers([store], lambda: now[0], 1e6)
    names = _names(6)
    for i, n in enumerate(names):
        tiers.computed(i, n, names[i - 1] if i else None)
    # the engine's PrefixLRU lets go of leaves: the 5th block, then the 4th (a leaf once the 5th
    # went), so the 6th is stranded and a lookup finds the first three (engine/kv/tiers/index.py)
    assert [n in store for n in names] == [True, True, True, False, False, True]
    assert store.counts["evictions"] == 2
    a, b = (SimpleNamespace(request=SimpleNamespace(index=i)) for i in (0, 1))
    assert tiers.held(a, names) is None and tiers.held(b, names[:2]) is None  # both read; b queues behind a
    t_a, t_b = 1e-4 + 3e6 / 1e9, 2 * 1e-4 + 5e6 / 1e9
    now[0] = t_a * 0.999
    assert not tiers.ready(a) and tiers.held(a, names) is None
    now[0] = t_a
    assert tiers.ready(a) and not tiers.ready(b) and tiers.held(a, names) == 3
    now[0] = t_b
    assert tiers.held(b, names[:2]) == 2
    assert store.counts["hits"] == 5 and store.fetch_seconds == pytest.approx(t_b)
    # no room in the pool yet: the next try takes what was read, reading nothing again (as the
    # engine's RankTiers keeps it); a pool that took the first block meanwhile: the blocks that continue it
    hits = store.counts["hits"]
    assert tiers.held(a, names[1:]) == 2 and store.counts["hits"] == hits
    tiers.fill(0, 0)  # admitted: the read is used up, a later prompt of the same request reads anew
    assert tiers.held(a, names[1:]) is None
    now[0] = 1.0
    assert tiers.held(a, names[1:]) == 2 and store.counts["hits"] == hits + 2


def test_b_a_full_write_queue_drops_blocks_as_the_engines_does():
    speed = TierSpeed(read_bytes_s=1e9, write_bytes_s=1e6, latency_s=0.0, source="test")  # 1 MB/s
    tiers = SimTiers([Store("disk", None, speed, 1 << 20)], lambda: 0.0, 1 << 20)
    names = _names(300)
    for i, n in enumerate(names):
        tiers.computed(i, n, None)
    assert tiers.dropped == 300 - 256 and len(tiers.stores[0].index) == 256  # 256 MiB queued at most


def test_c_the_shared_store_lets_one_replica_hit_what_another_computed(h200):
    first = random_requests(1, input_len=2048, output_len=32, vocab_size=32000, seed=5)[0]
    second = BenchRequest(first.prompt + list(range(64)), 32, after=0)  # sent when the first ends
    runs = {shared: simulate(MODEL, h200, Deployment(layout="TP1", replicas=2, router="round_robin",
                                                     prefix_caching=True, kv_shared=shared), [first, second])
            for shared in (False, True)}
    for r in runs.values():  # round robin: the second prompt goes to the other replica
        assert [e["prompt_tokens_computed"] for e in r["engines"]][0] == 2048
    assert runs[False]["engines"][1]["prompt_tokens_computed"] == 2112
    assert runs[True]["engines"][1]["prompt_tokens_computed"] == 64  # 128 blocks read from the store
    assert runs[True]["kv_tiers"]["tiers"]["shared"]["hits"] == 128
    assert runs[True]["kv_capacity"][0]["tokens"]["shared"] is None  # unbounded
    # the read: 128 blocks at one NVMe drive's 6.8 GB/s, shared by the node's two busy ranks, plus
    # its latency; here slower than the 2,048 tokens' prefill on an H200, which the TTFT then shows
    read_s = runs[True]["kv_tiers"]["tiers"]["shared"]["fetch_s"]
    assert read_s == pytest.approx(1e-4 + 128 * BLOCK / (6.8e9 / 2))
    ttft = {k: r["turns_ttft_ms"]["later"]["p50"] / 1e3 for k, r in runs.items()}
    assert read_s < ttft[True] < read_s + ttft[False] / 5  # the read, then 64 tokens' prefill


def test_d_calibrate_measures_the_tiers_and_the_topology_reads_them_back(tmp_path):
    figures, how = measure_tiers(quick=True, where=str(tmp_path))
    for tier in ("host", "disk"):
        assert figures[tier]["read_gb_s"] > 0 and figures[tier]["write_gb_s"] > 0
        assert figures[tier]["read_gb_s"] < 1000  # GB/s: bytes over seconds, not bytes over microseconds
    assert "DiskTier" in how and not list(tmp_path.iterdir())  # its directory is gone
    data = yaml.safe_load((PRESET_DIR / "local.yaml").read_text()) | {"kv_tiers": figures}
    write_yaml(data, tmp_path / "measured.yaml")
    topo = load_topology(str(tmp_path / "measured.yaml"))
    assert topo.kv_tiers.to_dict() == figures
    speeds = tier_speeds(topo, cpu=True, ranks_on_node=2)
    assert speeds["host"].read_bytes_s == pytest.approx(figures["host"]["read_gb_s"] * 1e9)
    assert speeds["disk"].read_bytes_s == pytest.approx(figures["disk"]["read_gb_s"] * 1e9 / 2)  # two ranks share it
    bad = data | {"kv_tiers": {"host": {"read_gb_s": -1}}}
    (tmp_path / "bad.yaml").write_text(yaml.safe_dump(bad))
    with pytest.raises(ConfigError, match="kv_tiers.host.read_gb_s=-1 must be a positive number"):
        load_topology(str(tmp_path / "bad.yaml"))


def test_sourced_defaults_for_a_gpu_node(h200):
    s = tier_speeds(h200, cpu=False, ranks_on_node=8)
    assert s["host"].read_bytes_s == pytest.approx(64e9 * 0.80)  # PCIe Gen5 x16 at PCIE_EFFICIENCY
    assert s["disk"].read_bytes_s == pytest.approx(6.8e9 / 8)  # one NVMe drive, eight ranks
    assert s["shared"] == s["disk"]  # one node: the store is a drive away
    two = tier_speeds(load_topology("dgx-h200", nodes=2), cpu=False, ranks_on_node=8)
    assert two["shared"].read_bytes_s <= two["disk"].read_bytes_s


def test_tiers_need_prefix_caching_and_sizes_in_range():
    with pytest.raises(ConfigError, match="they need prefix caching"):
        Deployment(kv_offload_gb=1.0)
    with pytest.raises(ConfigError, match="kv_offload_gb=-1"):
        Deployment(prefix_caching=True, kv_offload_gb=-1)
    assert Deployment(prefix_caching=True, kv_disk_gb=math.inf).tiered


def test_simulate_cli_takes_the_engines_tier_flags(capsys):
    code, out, err = run_cli(capsys, "simulate", "--model", MODEL, "--topology", "dgx-h200", "--multi-turn",
                             "--num-prompts", "8", "--turns", "3", "--input-len", "512", "--num-blocks", "64",
                             "--kv-offload-gb", "1", "--kv-disk-gb", "4", "--kv-shared", "--json", "--no-progress")
    assert code == 0, err
    r = json.loads(out)
    assert r["num_prompts"] == 24 and r["serve"]["completed"] == 24
    assert set(r["kv_tiers"]["tiers"]) == {"host", "disk", "shared"}
    assert r["kv_capacity"][0]["tokens"]["disk"] == math.floor(4 * 2**30 / (BLOCK + HEADER.size)) * 16
    assert r["turns_ttft_ms"]["later"]["p50"] is not None
    code, out, _ = run_cli(capsys, "simulate", "--model", MODEL, "--topology", "dgx-h200", "--num-prompts", "4",
                           "--kv-disk-dir", "/nonexistent", "--kv-shared", "redis://h:1", "--no-progress")
    assert code == 0 and "disk tier unbounded, shared store unbounded" in out
    for flags, says in ((["--kv-offload-gb", "-1"], "--kv-offload-gb -1.0: must be"),
                        (["--kv-offload-gb", "1", "--no-enable-prefix-caching"], "they need prefix caching")):
        code, _, err = run_cli(capsys, "simulate", "--model", MODEL, "--topology", "dgx-h200", "--num-prompts", "2",
                               *flags)
        assert code == 2 and len(err.strip().splitlines()) == 1 and says in err, err


def test_plan_says_how_many_tokens_the_tiers_keep(capsys):
    code, out, err = run_cli(capsys, "plan", "--model", "Llama-3.1-70B", "--topology", "dgx-h200", "--layouts", "TP8",
                             "--kv-offload-gb", "200", "--kv-disk-gb", "1000", "--format", "json", "--no-progress")
    assert code == 0, err
    tokens = json.loads(out)["kv_capacity_tokens"]
    block = 16 * 80 * 2 * 1 * 128 * 2  # TP8: one of the 8 kv heads a rank
    assert tokens["host"] == math.floor(200 * 2**30 / (block + HEADER.size)) * 16
    assert tokens["disk"] == math.floor(1000 * 2**30 / (block + HEADER.size)) * 16
    assert 0 < tokens["device"] < tokens["host"]
