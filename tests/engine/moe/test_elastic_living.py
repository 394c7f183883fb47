"""Elastic EP inside the living engine (--elastic-ep: engine/driver/elastic.py,
engine/rank/elastic_serve.py): `atoll generate` on a DP3EP3 engine of CPU ranks with a redundant
expert, a tiny Qwen3-MoE; rank 2 is killed mid-generation by --fault-injection kill. The
survivors regroup as DP2EP2, every request continues from the tokens the driver had seen, and
every output row holds transformers' greedy tokens. Then the same engine through the LLM API,
an expert whose only copy was on the lost rank missing from the checkpoint: the engine ends with
the one line naming it, every request failed with it."""

import json
import os
import re
import signal
import subprocess
import sys

import pytest
from cli import run_cli
from reference import reference_cache
from safetensors.torch import load_file, save_file

from atoll import LLM, SamplingParams
from atoll.engine.driver.online import EngineDead

PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7], [64, 65, 66, 67], [3, 1, 4, 1, 5]]
NEW = 16
FAMILIES = {"qwen3_moe": ("qwen3_moe", dict(num_experts=8))}
# 8 experts + 1 spare over 3 ranks: [0, 1, 2] [3, 4, 5] [6, 7, 0]; rank 2's 6 and 7 have no copy left
ELASTIC = ["--layout", "DP3EP3", "--enable-eplb", "--num-redundant-experts", "1", "--eplb-step-interval", "10000",
           "--elastic-ep", "--max-model-len", "64"]


@pytest.fixture(scope="module")
def references(tiny_model):
    return reference_cache(tiny_model, FAMILIES, PROMPTS, NEW)


def _generate_with_a_kill(references, tmp_path, flags, victim):
    model_dir, expected = references("qwen3_moe")
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"r{k}", "prompt_token_ids": p, "max_tokens": NEW,
                                           "ignore_eos": True}) + "\n" for k, p in enumerate(PROMPTS)))
    r = subprocess.run([sys.executable, "-m", "atoll", "generate", "--model", str(model_dir), "--prompts", str(prompts),
                        "--output", str(out), "--no-progress", *flags, "--fault-injection", f"kill:rank={victim}:step=6"],
                       capture_output=True, text=True, timeout=360,
                       env={**os.environ, "ATOLL_COLLECTIVE_TIMEOUT_S": "20", "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stderr
    rows = {row["id"]: row for row in map(json.loads, out.read_text().splitlines())}
    assert [rows[f"r{k}"].get("token_ids") for k in range(len(PROMPTS))] == expected
    assert f"rank {victim} lost (killed by SIGKILL)" in r.stderr, r.stderr
    return r.stderr


def _recovery(stderr, layout, victim):
    m = re.search(rf"serving again at {layout} without rank\(s\) \[{victim}\]: .* regrouped ([\d.]+) s after their "
                  r"collective failed, .*; (\d+) requests continue with their tokens, (\d+) expert slots read from the "
                  r"checkpoint", stderr)
    assert m, stderr
    return m


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("victim", [2, 0])
def test_generate_goes_on_at_reduced_dp_after_a_rank_is_killed(references, tmp_path, victim):
    """Rank 2 ([6, 7, 0]: 6 and 7 read again), or rank 0 ([0, 1, 2]: 1 and 2), the engine's
    first rank: the driver serves the elastic store and the channel moves to the new rank 0."""
    m = _recovery(_generate_with_a_kill(references, tmp_path, ELASTIC, victim), "DP2EP2", victim)
    # every request had started and none had ended at step 6 (16 tokens each): all continue;
    # two experts of each of the 3 MoE layers came back from the checkpoint
    assert int(m.group(2)) == len(PROMPTS) and int(m.group(3)) == 2 * 3
    assert float(m.group(1)) < 20
    print(f"recovery: {m.group(0)}")


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_dp4ep4_engine_regroups_long_before_its_collective_timeout(references, tmp_path):
    """DP4EP4 with 4 spares ([0, 1, 2] [3, 4, 5] [6, 7, 0] [1, 2, 3]) loses rank 3: every expert
    keeps a copy. A survivor whose ring all_gather was sending to a peer that had noticed used
    to wait out the collective timeout (20 s here): the peer held its groups until the rebuild.
    Each rank now lets go of them before it leaves (ParallelContext.release), so their
    connections close and every survivor notices at once."""
    flags = [{"DP3EP3": "DP4EP4", "1": "4"}.get(f, f) for f in ELASTIC]
    m = _recovery(_generate_with_a_kill(references, tmp_path, flags, 3), "DP3EP3", 3)
    assert int(m.group(2)) == len(PROMPTS) and int(m.group(3)) == 0
    assert float(m.group(1)) < 5, m.group(0)  # not the 20 s timeout
    print(f"recovery: {m.group(0)}")


def _without_expert(model_dir, out_dir, layer: int, expert: int):
    """A copy of model_dir whose layer's expert lives in a file of its own (experts.safetensors),
    beside model.safetensors with everything else, both named by an index."""
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors |= load_file(f)
    prefix = f"model.layers.{layer}.mlp.experts.{expert}."
    apart = {n: t for n, t in tensors.items() if n.startswith(prefix)}
    assert apart
    out_dir.mkdir()
    for f in model_dir.iterdir():
        if f.suffix == ".json" and "index" not in f.name:
            (out_dir / f.name).write_bytes(f.read_bytes())
    save_file({n: t for n, t in tensors.items() if n not in apart}, out_dir / "model.safetensors")
    save_file(apart, out_dir / "experts.safetensors")
    index = {n: ("experts.safetensors" if n in apart else "model.safetensors") for n in tensors}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    return out_dir / "experts.safetensors"


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_an_expert_without_a_source_ends_the_engine_with_its_line(references, tmp_path, monkeypatch):
    model_dir, _ = references("qwen3_moe")
    monkeypatch.setenv("ATOLL_COLLECTIVE_TIMEOUT_S", "20")
    apart = _without_expert(model_dir, tmp_path / "m", 1, 7)
    llm = LLM(tmp_path / "m", layout="DP3EP3", enable_eplb=True, num_redundant_experts=1, eplb_step_interval=10_000,
              elastic_ep=True, max_model_len=64, fault_injection="kill:rank=2:step=6")
    try:
        llm.start()  # every rank has read its weights
        apart.unlink()  # expert 7 of layer 1 (only on rank 2) can no longer be read again
        errors = {}
        params = SamplingParams(max_tokens=NEW, ignore_eos=True)
        with pytest.raises(EngineDead) as e:
            llm.generate_requests(llm.prepare([{"prompt_token_ids": p} for p in PROMPTS], params), errors=errors,
                                  timeout_s=200)
    finally:
        llm.close()
    line = str(e.value)
    assert line.startswith("expert 7 of MoE layer 1 has no source: its every copy was on the lost ep rank(s) [2]")
    assert "\n" not in line
    assert errors == {k: line for k in range(len(PROMPTS))}


@pytest.mark.parametrize("flags,error", [
    (["--layout", "EP2", "--enable-eplb", "--num-redundant-experts", "1"],
     "--elastic-ep: layout TP2EP2 cannot go on without a rank; it needs DP-attention/EP, DPnEPn with n >= 2"),
    (["--layout", "DP2EP2", "--enable-eplb"], "--elastic-ep needs --enable-eplb and --num-redundant-experts R >= 1"),
    (["--layout", "DP2EP2"], "--elastic-ep needs --enable-eplb and --num-redundant-experts R >= 1"),
])
def test_elastic_ep_is_refused_in_one_line_where_it_cannot_run(tiny_model, capsys, flags, error):
    model_dir = tiny_model("qwen3_moe", num_experts=8)
    code, out, err = run_cli(capsys, "generate", "--model", model_dir, "--prompt", "x", "--elastic-ep", *flags)
    assert code == 2 and out == ""
    assert err.startswith(f"atoll: error: {error}") and err.count("\n") == 1, err


def test_elastic_ep_is_refused_under_a_launcher_that_runs_one_job_per_call(tiny_model):
    from atoll.engine.driver.llm import LLM as EngineLLM
    from atoll.errors import InputError
    from atoll.launch.local import run_local

    llm = EngineLLM(tiny_model("qwen3_moe", num_experts=8), layout="DP2EP2", launcher=run_local, enable_eplb=True,
                    num_redundant_experts=1, elastic_ep=True)
    with pytest.raises(InputError, match="^--elastic-ep runs under the local or the Ray launcher, not function "):
        llm.generate_requests(llm.prepare([{"prompt_token_ids": [5, 6]}], SamplingParams(max_tokens=2)))


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_silent_rank_is_left_out_and_named_by_the_driver(references, monkeypatch):
    """`drop`: rank 2 stays alive and beating but sends nothing more; its peers notice at the
    collective timeout and go on as DP2EP2; the driver learns it from them and ends it."""
    model_dir, expected = references("qwen3_moe")
    monkeypatch.setenv("ATOLL_COLLECTIVE_TIMEOUT_S", "6")
    llm = LLM(model_dir, layout="DP3EP3", enable_eplb=True, num_redundant_experts=1, eplb_step_interval=10_000,
              elastic_ep=True, max_model_len=64, fault_injection="drop:rank=2:step=6")
    try:
        engine = llm.start()
        victim = engine.job.procs[2]
        params = SamplingParams(max_tokens=NEW, ignore_eos=True)
        out = llm.generate_requests(llm.prepare([{"prompt_token_ids": p} for p in PROMPTS], params), timeout_s=200)
        assert [r["token_ids"] for r in out] == expected
        assert engine.healthy and str(engine.layout) == "DP2EP2"
        assert engine.degraded == {2: "left out by its peers: it stopped answering within the collective timeout; "
                                      "the engine serves on at DP2EP2"}
        (rec,) = engine.recoveries
        assert rec["lost"] == [2] and 6.0 * 0.9 < rec["stalled_s"] < 6.0 + 3, rec
        victim.join(10)
        assert victim.exitcode is not None  # ended by the driver
        print(f"drop: rank 0 failed {rec['stalled_s']:.2f}s after its last step (timeout 6 s); serving again "
              f"{rec['recovery_s']:.2f}s after the driver heard")
    finally:
        llm.close()


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_losses_in_turn_leave_one_rank_serving_with_transformers_tokens(references, monkeypatch):
    """SIGKILL to rank 2 once the streams have 18 tokens, then to rank 1 at the first tokens
    after the recovery: DP3EP3 -> DP2EP2 -> one rank, every request exact. (A 30 ms delay a
    step on rank 0 before the first loss keeps the first kill inside the run.)"""
    model_dir, expected = references("qwen3_moe")
    monkeypatch.setenv("ATOLL_COLLECTIVE_TIMEOUT_S", "20")
    llm = LLM(model_dir, layout="DP3EP3", enable_eplb=True, num_redundant_experts=1, eplb_step_interval=10_000,
              elastic_ep=True, max_model_len=64, fault_injection="delay:rank=0:ms=30")
    try:
        engine = llm.start()
        pids, killed = engine.job.pids, []

        def on_step(done, tokens):
            if tokens >= 18 and not killed:
                killed.append(2)
                os.kill(pids[2], signal.SIGKILL)
            elif len(killed) == 1 and engine.recoveries:
                killed.append(1)
                os.kill(pids[1], signal.SIGKILL)

        params = SamplingParams(max_tokens=NEW, ignore_eos=True)
        out = llm.generate_requests(llm.prepare([{"prompt_token_ids": p} for p in PROMPTS], params), on_step=on_step,
                                    timeout_s=200)
        assert [r["token_ids"] for r in out] == expected
        assert killed == [2, 1] and [(r["lost"], r["layout"]) for r in engine.recoveries] == [([2], "DP2EP2"),
                                                                                             ([1], "TP1")]
        assert engine.healthy and set(engine.degraded) == {1, 2}
    finally:
        llm.close()
