"""Plans that run: `atoll plan --save` writes a plan file that loads back the same, bad files
give one line, `atoll generate --plan` runs exactly its layout with the islands it names (a
Qwen3-MoE at EP4 over 2 simulated islands of 2 takes the two-level dispatch path and gives
transformers' tokens), a job whose ranks sit elsewhere is reported, and `--layout auto` plans
on this machine."""

import json
from pathlib import Path

import pytest
import yaml
from cli import run_cli
from reference import reference_tokens

from atoll.errors import ConfigError, LaunchError
from atoll.parallel.layout import Layout
from atoll.parallel.placement import Placement, check_job_placement, placement_mismatches
from atoll.planner.planfile import load_plan

PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8]]
NEW = 8
# one node of 4 simulated GPUs in 2 NVLink islands of 2
SIM = dict(name="sim-2x2", gpus_per_node=4, islands=2,
           gpu=dict(name="sim", memory_gib=16, hbm_tb_s=1, bf16_tflops=100),
           links=dict(nvlink=dict(gb_s=100, latency_us=3), pcie=dict(gb_s=10, latency_us=5),
                      network=dict(kind="ethernet", gb_s=1.25, latency_us=50, shared=True)))

# a request mix that fits the tiny models' 256-token context (the planner refuses one that does not)
FITS = ("--isl", "64", "--osl", "16")


@pytest.fixture(scope="module")
def moe(tiny_model):
    return tiny_model("qwen3_moe", num_experts=8)


@pytest.fixture(scope="module")
def plan_file(moe, tmp_path_factory):
    d = tmp_path_factory.mktemp("plan")
    topo = d / "sim.yaml"
    topo.write_text(yaml.safe_dump(SIM))
    return d, topo


def _save(capsys, moe, topo, out, layout="EP4"):
    code, _, err = run_cli(capsys, "plan", *FITS, "--model", str(moe), "--topology", str(topo), "--layouts", layout,
                           "--save", str(out))
    assert code == 0, err
    assert f"wrote {out}: plan: {Layout.parse(layout)}" in err
    return out


def test_plan_file_round_trips(capsys, moe, plan_file):
    from atoll.models.config import ModelConfig
    from atoll.planner import Workload, plan_layouts
    from atoll.planner.planfile import from_plan, plan_yaml
    from atoll.topologies import topology_from_dict

    d, topo = plan_file
    path = _save(capsys, moe, topo, d / "plan.yaml")
    saved = load_plan(path)
    assert saved.layout == Layout.parse("EP4") and saved.replicas == 1
    assert saved.placement.slots == ((0, 0), (0, 1), (0, 2), (0, 3)) and saved.islands == (0, 0, 1, 1)
    assert saved.topology == topology_from_dict(SIM)
    assert set(saved.predictions) >= {"ttft_ms", "tpot_ms", "tokens_per_s_per_gpu", "binding"}
    assert saved.predictions["binding"].startswith("TP4EP4")  # then the MoE options the search chose, if any
    assert saved.engine_options() == {k: v for k, v in {
        "enable_eplb": saved.workload.get("eplb"), "num_redundant_experts": saved.workload.get("redundant_experts"),
        "enable_two_batch_overlap": saved.workload.get("two_batch_overlap")}.items() if v}
    saved.check_model(ModelConfig.load(moe))
    assert load_plan(path) == saved and plan_yaml(saved) == path.read_text()  # written as read
    # the planner's Plan on a two-node preset: the placement and the topology come back whole
    from atoll.topologies import load_topology

    two = load_topology("dgx-h200", nodes=2, gpus_per_node=2)
    plan = plan_layouts(ModelConfig.load(moe), two, Workload(concurrency=4, isl=64, osl=16), layouts=["TP2PP2"])
    saved = from_plan(plan, ModelConfig.load(moe))
    (d / "two.yaml").write_text(plan_yaml(saved))
    back = load_plan(d / "two.yaml")
    assert back.topology == two and back.placement == plan.placement and back.placement.nodes == [0, 1]


def _edit(path, out, fn):
    d = yaml.safe_load(Path(path).read_text())
    fn(d)
    out.write_text(yaml.safe_dump(d))
    return out


BAD = [
    (lambda d: d.pop("atoll_plan"), "not an atoll plan"),
    (lambda d: d.update(atoll_plan=9), "plan format 9"),
    (lambda d: d.pop("placement"), "missing field 'placement'"),
    (lambda d: d.update(layout="TP3Q"), "cannot parse layout"),
    (lambda d: d["placement"].pop(), "placement lists 3 ranks; layout TP4EP4 has 4"),
    (lambda d: d["placement"][1].update(node="nodeX"), "rank 1 is on node 'nodeX'"),
    (lambda d: d["placement"][2].update(gpu=7), "rank 2 is on GPU 7 of node0"),
    (lambda d: d["placement"][2].update(island=0), "rank 2 says island 0"),
    (lambda d: d["placement"][3].update(gpu=2), "two ranks on one GPU"),
    (lambda d: d["topology"]["gpu"].update(speed=1), "unknown field 'topology.gpu.speed'"),
    (lambda d: d["topology"].pop("links"), "missing field 'topology.links'"),
    (lambda d: d["topology"].update(islands=[[[0, 0]]]), "islands cover 1 GPUs"),
]


@pytest.mark.parametrize("edit,message", BAD, ids=[m for _, m in BAD])
def test_bad_plan_files_give_one_line(capsys, moe, plan_file, tmp_path, edit, message):
    d, topo = plan_file
    good = d / "plan.yaml" if (d / "plan.yaml").exists() else _save(capsys, moe, topo, d / "plan.yaml")
    bad = _edit(good, tmp_path / "bad.yaml", edit)
    with pytest.raises(ConfigError) as e:
        load_plan(bad)
    assert message in str(e.value) and str(bad) in str(e.value) and "\n" not in str(e.value)


def test_generate_refuses_bad_plans_in_one_line(capsys, moe, plan_file, tmp_path, tiny_model):
    d, topo = plan_file
    good = d / "plan.yaml" if (d / "plan.yaml").exists() else _save(capsys, moe, topo, d / "plan.yaml")
    other = tiny_model("qwen3_moe", num_experts=4)
    capsys.readouterr()
    for plan, model, message in [(tmp_path / "none.yaml", moe, "no plan file at"),
                                 (good, other, f"the plan is for {moe.name}, but --model {other} differs")]:
        code, out, err = run_cli(capsys, "generate", "--model", str(model), "--plan", str(plan),
                                 "--prompt", "x")
        lines = err.strip().splitlines()
        assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
        assert message in lines[0]
    code, _, err = run_cli(capsys, "generate", "--model", str(moe), "--plan", str(good), "--layout", "EP2",
                           "--prompt", "x")
    assert code == 2 and "give --plan or --layout, not both" in err
    # the shapes that differ are named
    code, _, err = run_cli(capsys, "generate", "--model", str(other), "--plan", str(good), "--prompt", "x")
    assert "num_experts=4 (plan: 8)" in err


def test_job_placement_checked_against_the_plan():
    from atoll.topologies import load_topology

    two = load_topology("dgx-h200", nodes=2, gpus_per_node=2)
    p = Placement.build(Layout.parse("TP2PP2"), two)
    assert placement_mismatches(p, ["a", "a", "b", "b"], [0, 1, 0, 1]) == []  # preset names: by grouping
    diff = placement_mismatches(p, ["a", "a", "a", "b"], [0, 1, 2, 0])
    assert diff == ["rank 2 on a (plan: node1, which runs on b)", "rank 2 on GPU 2 (plan: GPU 0)",
                    "rank 3 on GPU 0 (plan: GPU 1)"]
    named = Placement(p.layout, p.slots, ("hostA", "hostB"), p.island)
    assert placement_mismatches(named, ["hostA.lan", "hostA", "hostB", "hostB"], [0, 1, 0, 1]) == []
    assert placement_mismatches(named, ["hostA", "hostB", "hostB", "hostB"], [0, 1, 0, 1]) == \
        ["rank 1 on hostB (plan: hostA)"]
    line = check_job_placement(named, ["hostA", "hostB", "hostB", "hostB"], [0, 1, 0, 1], strict=False)
    assert line == "the job's ranks differ from the plan: rank 1 on hostB (plan: hostA)"
    with pytest.raises(LaunchError, match="--strict-placement"):
        check_job_placement(named, ["hostA", "hostB", "hostB", "hostB"], [0, 1, 0, 1], strict=True)


def test_local_launcher_refuses_a_two_node_plan(capsys, moe, tmp_path):
    code, _, err = run_cli(capsys, "plan", *FITS, "--model", str(moe), "--topology", "dgx-h200", "--nodes", "2",
                           "--gpus-per-node", "2", "--layouts", "EP2PP2", "--save", str(tmp_path / "p.yaml"))
    assert code == 0, err
    code, _, err = run_cli(capsys, "generate", "--model", str(moe), "--plan", str(tmp_path / "p.yaml"),
                           "--prompts", str(_prompts(tmp_path)), "--launcher", "local")
    assert code == 2 and "the plan puts ranks on 2 nodes (node0, node1)" in err


# ---- runs ---------------------------------------------------------------------------------


def _prompts(tmp_path):
    p = tmp_path / "prompts.jsonl"
    p.write_text("".join(json.dumps({"id": i, "prompt_token_ids": t}) + "\n" for i, t in enumerate(PROMPTS)))
    return p


def _counting_worker(rank, world_size, spec, requests, parallel):
    """A one-shot EP4 run (dp 1), recording each MoE layer's dispatch: whether it ran
    two-level, its cross-island row bytes, the fewest any dispatcher could send (routing.min_rows),
    and the collectives each ep group saw."""
    import torch

    from atoll.comm.routing import min_rows
    from atoll.engine.rank.loop import run_batch
    from atoll.engine.rank.runner import ModelRunner
    from atoll.layers.moe import SparseMoE
    from atoll.parallel.mesh import ParallelContext

    ctx = ParallelContext.create(Layout.parse(spec.layout), rank, options=parallel)
    runner = ModelRunner(spec, ctx)
    layers = [m for m in runner.model.modules() if isinstance(m, SparseMoE)]
    minimum = {"cross": 0}
    for m in layers:
        d = m.dispatcher

        def counted(x, ids, w, d=d, inner=d.dispatch, **options):
            minimum["cross"] += min_rows(ids, d.split, d.island_of, d.group.rank)["cross"] * x.shape[1] * 4
            return inner(x, ids, w, **options)

        d.dispatch = counted
    for g in ctx.groups.values():
        g.reset_counters()
    results = run_batch(runner, requests)
    torch.distributed.barrier()
    return dict(results=results if rank == 0 else None, two_level=[m.dispatcher.two_level for m in layers],
                cross=sum(m.dispatcher.row_bytes["cross"] for m in layers), minimum=minimum["cross"],
                calls={k: (ctx.groups[k].size, dict(ctx.groups[k].calls)) for k in ("ep", "ep_island", "ep_rail")})


@pytest.mark.timeout(200)
def test_ep4_over_two_islands_is_two_level_and_matches_transformers(moe):
    from atoll import LLM, SamplingParams
    from atoll.launch.local import run_local
    from atoll.parallel.mesh import ContextOptions

    want = reference_tokens(moe, PROMPTS, NEW)
    llm = LLM(moe, layout="EP4")
    requests = llm.prepare(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    out = run_local(_counting_worker, 4, llm.spec(requests), requests,
                    ContextOptions(islands=(0, 0, 1, 1)), timeout_s=150)
    assert [r["token_ids"] for r in out[0]["results"]] == want
    for rank, r in enumerate(out):
        assert r["two_level"] == [True] * 3, rank
        size, calls = r["calls"]["ep"]
        assert size == 4 and "all_to_all" not in calls, f"rank {rank}: an all_to_all spanned the ep group"
        assert r["calls"]["ep_island"][0] == r["calls"]["ep_rail"][0] == 2
        assert r["calls"]["ep_rail"][1]["all_to_all"] > 0 and r["calls"]["ep_island"][1]["all_to_all"] > 0
    sent, minimum = sum(r["cross"] for r in out), sum(r["minimum"] for r in out)
    assert minimum > 0 and sent == 2 * minimum  # out and back, each the fewest rows


@pytest.mark.timeout(200)
def test_generate_runs_the_plan(capsys, moe, plan_file, tmp_path):
    d, topo = plan_file
    plan = d / "plan.yaml" if (d / "plan.yaml").exists() else _save(capsys, moe, topo, d / "plan.yaml")
    out = tmp_path / "out.jsonl"
    code, _, err = run_cli(capsys, "generate", "--model", str(moe), "--plan", str(plan), "--prompts",
                           str(_prompts(tmp_path)), "--max-new-tokens", str(NEW), "--output", str(out),
                           "--no-progress", "--dispatch", "hierarchical")
    assert code == 0, err
    chosen = load_plan(plan).summary().split(" on 1 node(s)")[0]  # the layout, then the MoE options it chose
    assert f"{chosen} on 1 node(s) of sim-2x2 (node0; 2 island(s)); predicted TTFT" in err
    assert "on TP4EP4 (4 ranks, local)" in err
    got = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    assert [got[i] for i in range(len(PROMPTS))] == reference_tokens(moe, PROMPTS, NEW)


@pytest.mark.timeout(200)
def test_layout_auto_plans_here_and_matches_transformers(capsys, tiny_model, tmp_path):
    model = tiny_model("llama")
    out = tmp_path / "out.jsonl"
    code, _, err = run_cli(capsys, "generate", "--model", str(model), "--layout", "auto", "--device", "cpu",
                           "--prompts", str(_prompts(tmp_path)), "--max-new-tokens", str(NEW), "--output",
                           str(out), "--no-progress")
    assert code == 0, err
    chosen = [ln for ln in err.splitlines() if ln.startswith("atoll: plan: ")]
    assert len(chosen) == 1 and " of local " in chosen[0] and "predicted TTFT" in chosen[0], err
    got = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    assert [got[i] for i in range(len(PROMPTS))] == reference_tokens(model, PROMPTS, NEW)
