"""Bytes by link class (parallel.links, `atoll generate --stats`): the classes of rank pairs
and groups, and a Qwen3-MoE at EP4 over 2 simulated islands of one node, whose cross-island
MoE rows (the node class here) are the analytic minimum out and back (comm.routing.min_rows),
the same figure `atoll generate --plan ... --stats` prints."""

import functools
import json
import re
from collections import Counter

import pytest
import yaml
from cli import run_cli

from atoll.parallel.links import cross_island_class, group_class, lines, pair_class, total

PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8]]
NEW = 8
ISLANDS = (0, 0, 1, 1)
# one node of 4 simulated GPUs in 2 NVLink islands of 2
SIM = dict(name="sim-2x2", gpus_per_node=4, islands=2,
           gpu=dict(name="sim", memory_gib=16, hbm_tb_s=1, bf16_tflops=100),
           links=dict(nvlink=dict(gb_s=100, latency_us=3), pcie=dict(gb_s=10, latency_us=5),
                      network=dict(kind="ethernet", gb_s=1.25, latency_us=50, shared=True)))

# a request mix that fits the tiny models' 256-token context (the planner refuses one that does not)
FITS = ("--isl", "64", "--osl", "16")


def test_link_classes_of_pairs_and_groups():
    islands, one_node, two_nodes = ISLANDS, (0, 0, 0, 0), (0, 0, 1, 1)
    assert [pair_class(0, b, islands, one_node) for b in range(4)] == ["island", "island", "node", "node"]
    assert [pair_class(0, b, islands, two_nodes) for b in range(4)] == ["island", "island", "network", "network"]
    assert pair_class(0, 3, (0, 0, 0, 0), two_nodes) == "island"  # an island across nodes (NVL72): NVLink
    assert group_class([0, 1], islands, two_nodes) == "island"
    assert group_class([0, 1, 2], islands, one_node) == "node"
    assert group_class([1, 2], islands, two_nodes) == "network"
    assert group_class([3], islands, two_nodes) is None
    assert cross_island_class(range(4), islands, one_node) == "node"
    assert cross_island_class(range(4), islands, two_nodes) == "network"
    # islands of one GPU on two nodes: some cross-island pairs share a node, some do not
    assert cross_island_class(range(4), (0, 1, 2, 3), two_nodes) == "network"


def test_lines_one_per_class():
    part = {"dispatch": Counter(island=1000, node=24), "rows": Counter(island=800, node=16),
            "collectives": Counter(island=5000, network=1234567), "calls": Counter(island=10, network=3),
            "ranks": Counter(all=1, compiled=0)}
    got = lines(total([part, part, None]))
    assert got == [
        "island links:   MoE dispatch 2,000 B (rows 1,600 B), collectives 10,000 B in 20 calls, summed over 2 ranks",
        "node links:     MoE dispatch 48 B (rows 32 B), collectives 0 B in 0 calls, summed over 2 ranks",
        "network links:  MoE dispatch 0 B (rows 0 B), collectives 2,469,134 B in 6 calls, summed over 2 ranks",
    ]
    part["ranks"]["compiled"] = 1
    assert lines(total([part]))[-1] == ("1 of 1 ranks ran compiled decode steps, whose collectives are not "
                                        "counted (--enforce-eager counts them)")


def _numbers(line: str) -> list[int]:
    """[dispatch, rows, collectives, calls, ranks] of one --stats line."""
    return [int(n.replace(",", "")) for n in re.findall(r"\b\d[\d,]*\b", line.split("links:", 1)[1])]


def _counting_worker(rank, world_size, spec, requests, parallel):
    """A one-shot run with each MoE layer's fewest possible cross-island rows counted
    (routing.min_rows), and parallel.links' counts of the same run."""
    import torch

    from atoll.comm.routing import min_rows
    from atoll.engine.rank.loop import run_batch
    from atoll.engine.rank.runner import ModelRunner
    from atoll.parallel import links
    from atoll.parallel.layout import Layout
    from atoll.parallel.mesh import ParallelContext

    ctx = ParallelContext.create(Layout.parse(spec.layout), rank, options=parallel)
    runner = ModelRunner(spec, ctx)
    minimum = {"cross": 0}
    for m in runner.model.modules():
        d = getattr(m, "dispatcher", None)
        if d is None:
            continue

        def counted(x, ids, w, d=d, inner=d.dispatch, **options):
            fewest = min_rows(ids, d.split, d.island_of, d.group.rank)["cross"]
            minimum["cross"] += fewest * x.shape[1] * x.element_size()
            return inner(x, ids, w, **options)

        d.dispatch = counted
    links.reset(ctx, runner.model)
    run_batch(runner, requests)
    torch.distributed.barrier()
    return dict(minimum=minimum["cross"], counted=links.rank_bytes(ctx, runner.model))


@pytest.fixture(scope="module")
def moe(tiny_model):
    return tiny_model("qwen3_moe", num_experts=8)


@functools.lru_cache(maxsize=None)
def _counted(moe):
    from atoll import LLM, SamplingParams
    from atoll.launch.local import run_local
    from atoll.parallel.mesh import ContextOptions

    llm = LLM(moe, layout="EP4")
    requests = llm.prepare(PROMPTS, SamplingParams(max_tokens=NEW))  # as the CLI asks
    out = run_local(_counting_worker, 4, llm.spec(requests), requests, ContextOptions(islands=ISLANDS),
                    timeout_s=150)
    return sum(r["minimum"] for r in out), total(r["counted"] for r in out)


@pytest.mark.timeout(200)
def test_cross_island_moe_rows_are_the_analytic_minimum(moe):
    minimum, summed = _counted(moe)
    # one node: cross-island bytes are the node class; out and back, each the fewest rows
    assert minimum > 0 and summed["rows"]["node"] == 2 * minimum
    assert summed["rows"]["network"] == summed["dispatch"]["network"] == 0
    assert summed["dispatch"]["node"] > summed["rows"]["node"]  # plus the routing metadata
    assert summed["rows"]["island"] > 0
    assert summed["collectives"]["node"] > 0 and summed["collectives"]["network"] == 0  # the rails


@pytest.mark.timeout(200)
def test_generate_stats_prints_one_line_per_class(capsys, moe, tmp_path):
    topo = tmp_path / "sim.yaml"
    topo.write_text(yaml.safe_dump(SIM))
    plan = tmp_path / "plan.yaml"
    code, _, err = run_cli(capsys, "plan", *FITS, "--model", str(moe), "--topology", str(topo), "--layouts", "EP4",
                           "--save", str(plan), "--enable-eplb", "off", "--two-batch-overlap", "off")
    assert code == 0, err
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt_token_ids": t}) + "\n" for i, t in enumerate(PROMPTS)))
    code, _, err = run_cli(capsys, "generate", "--model", str(moe), "--plan", str(plan), "--prompts", str(prompts),
                           "--max-new-tokens", str(NEW), "--output", str(tmp_path / "out.jsonl"), "--no-progress",
                           "--stats", "--expert-load-out", str(tmp_path / "load.json"))
    assert code == 0, err
    _check_the_load_file(capsys, moe, topo, tmp_path / "load.json")
    tail = [ln for ln in err.strip().splitlines() if "wrote" not in ln][-3:]
    assert [ln.split()[1] for ln in tail] == ["island", "node", "network"], err
    got = {ln.split()[1]: _numbers(ln) for ln in tail}
    minimum, summed = _counted(moe)
    assert got["node"][1] == 2 * minimum  # the cross-island rows, at the analytic minimum
    for cls in ("island", "node", "network"):
        assert got[cls] == [summed["dispatch"][cls], summed["rows"][cls], summed["collectives"][cls],
                            summed["calls"][cls], 4], (cls, got[cls])


def _check_the_load_file(capsys, moe, topo, path):
    """--expert-load-out: each layer's tokens per logical expert, adding up to its tokens per
    rank; `atoll plan --expert-loads` places from it, and the file is never written over."""
    load = json.loads(path.read_text())["layers"]
    assert load and all(len(v["experts"]) == 8 and sum(v["experts"]) == sum(v["tokens"]) > 0 for v in load.values())
    code, out, err = run_cli(capsys, "plan", *FITS, "--model", str(moe), "--topology", str(topo), "--layouts", "EP4",
                             "--expert-loads", str(path), "--enable-eplb", "on", "--format", "json")
    assert code == 0, err
    code, _, err = run_cli(capsys, "plan", *FITS, "--model", str(moe), "--topology", str(topo),
                           "--expert-loads", str(path.parent / "missing.json"))
    assert code != 0 and "--expert-loads" in err and "cannot read it" in err
