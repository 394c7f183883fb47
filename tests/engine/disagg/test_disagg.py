"""Disaggregated prefill and decode (engine.disagg.roles, engine.disagg.transfer): the transfer plan
(every held head of every layer sent once, bytes = the analytic KV size), the conditional
routing, and greedy tokens identical to transformers across prefill -> decode layouts, with
the KV bytes each request sent counted on the ranks."""

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import spawned_children
from reference import reference_cache, reference_tokens

from atoll import LLM, SamplingParams
from atoll.engine.disagg import transfer as kv_transfer
from atoll.engine.disagg import decision
from atoll.models.config import ModelConfig
from atoll.parallel.layout import Layout
from atoll.parallel.pipeline import stage_layers

PROMPTS = [[(7 * i + j) % 300 + 1 for j in range(5 + 6 * i)] for i in range(4)]  # 5, 11, 17, 23 tokens
NEW = 6


class _Config:  # what the plan reads of a ModelConfig
    def __init__(self, layers, kv_heads, head_dim=16, pp_layers=None):
        self.num_hidden_layers, self.num_key_value_heads, self.head_dim = layers, kv_heads, head_dim
        self.hidden_size, self.intermediate_size, self.num_attention_heads, self.vocab_size = 64, 128, 8, 301
        self.moe_intermediate_size = None


@pytest.mark.parametrize("src,dst,kv", [("TP1", "TP2", 2), ("TP2", "TP1", 2), ("TP2", "PP2", 2), ("TP4", "TP2PP2", 8),
                                        ("TP4", "TP1", 2), ("PP2", "TP4", 2), ("TP2PP2", "DP2PP2", 4)])
def test_plan_sends_each_held_head_of_each_layer_once(src, dst, kv):
    cfg, src, dst = _Config(6, kv), Layout.parse(src), Layout.parse(dst)
    for replica in range(dst.dp):
        messages = kv_transfer.plan(cfg, src, dst, replica)
        got = {}
        for m in messages:
            for layer in m.layers:
                for h in m.heads:
                    key = (m.dst, layer, h)
                    assert key not in got, f"{key} sent twice"
                    got[key] = m.src
        want = set()
        for q in range(dst.world_size):
            stage, rest = divmod(q, dst.stage_size)
            d, t = divmod(rest, dst.tp)
            if d != replica:
                continue
            start, end = stage_layers(cfg, dst.pp)[stage]
            want |= {(q, layer, h) for layer in range(start, end) for h in kv_transfer.heads_held(kv, dst.tp, t)}
        assert set(got) == want
        # the sender holds what it sends
        for (q, layer, h), p in got.items():
            stage, t = divmod(p, src.stage_size)
            start, end = stage_layers(cfg, src.pp)[stage]
            assert start <= layer < end and h in kv_transfer.heads_held(kv, src.tp, t)
        tokens = 7
        sent = sum(len(m.layers) * 2 * tokens * len(m.heads) * cfg.head_dim * 4 for m in messages)
        assert sent == kv_transfer.analytic_bytes(cfg, dst, tokens, 4)


def test_short_and_mostly_cached_prompts_stay_on_the_decode_engine():
    long_a = list(range(1, 24))  # 23 tokens
    long_b = long_a[:20] + [200, 201, 202]  # shares 5 full blocks of 4 with long_a
    prompts = [[5, 6, 7], long_a, long_b, list(range(50, 73))]

    def paths(prefix_caching, dp=1):
        seen = [set() for _ in range(dp)]
        out = []
        for k, ids in enumerate(prompts):
            new = decision.uncached_tokens(ids, seen[k % dp], block_size=4, prefix_caching=prefix_caching)
            out.append(decision.choose_path(new, [0], min_prompt_tokens=10, max_prefill_queue=None).reason)
        return out

    assert paths(True) == ["decode", "prefill", "decode", "prefill"]
    assert paths(False) == ["decode", "prefill", "prefill", "prefill"]
    # each decode replica has its own cache: long_b on the other replica than long_a is not cached
    assert paths(True, dp=2) == ["decode", "prefill", "prefill", "prefill"]
    # a full prefill queue, or every prefill engine dead, keeps long prompts local too
    assert decision.choose_path(30, [2, 1], min_prompt_tokens=10, max_prefill_queue=3) == decision.Path(False, 1, "queue")
    assert decision.choose_path(30, [math.inf, 1], min_prompt_tokens=10, max_prefill_queue=None) == decision.Path(True, 1, "prefill")
    assert decision.choose_path(30, [math.inf], min_prompt_tokens=10, max_prefill_queue=None).reason == "queue"


CASES = {"llama": ("llama", {}), "qwen3_moe": ("qwen3_moe", {}), "deepseek_v3": ("deepseek_v3", {})}


@pytest.fixture(scope="module")
def models(tiny_model):
    return reference_cache(tiny_model, CASES, PROMPTS, NEW)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name,prefill,decode", [("llama", "TP1", "TP2"), ("llama", "TP2", "TP1"),
                                                 ("llama", "TP2", "PP2"), ("qwen3_moe", "EP2", "DP2EP2"),
                                                 ("deepseek_v3", "TP1", "TP2")])  # MLA: the latent cache goes over
def test_disaggregated_tokens_match_and_bytes_are_the_prompt_kv(models, name, prefill, decode):
    model_dir, want = models(name)
    llm = LLM(model_dir, prefill=prefill, decode=decode, block_size=4)
    outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True), timeout_s=240)
    assert [o.token_ids for o in outs] == want
    assert [o.metrics["prefilled_on"] for o in outs] == ["prefill"] * len(PROMPTS)
    cfg = ModelConfig.load(model_dir)
    assert [o.metrics["kv_bytes_sent"] for o in outs] == [
        kv_transfer.analytic_bytes(cfg, Layout.parse(decode), len(p), 4) for p in PROMPTS]


@pytest.mark.timeout(300)
def test_short_prompts_are_prefilled_on_the_decode_engine(models):
    model_dir, want = models("llama")
    llm = LLM(model_dir, prefill="TP1", decode="TP1", block_size=4, disagg_min_prompt_tokens=12)
    params = [SamplingParams(max_tokens=NEW, ignore_eos=True)] * 3 + [SamplingParams(max_tokens=1, ignore_eos=True)]
    outs = llm.generate(PROMPTS, params, timeout_s=240)
    assert [o.token_ids for o in outs] == want[:3] + [want[3][:1]]
    assert [o.metrics["prefilled_on"] for o in outs] == ["decode", "decode", "prefill", "prefill"]
    assert [o.metrics["kv_bytes_sent"] > 0 for o in outs] == [False, False, True, True]
    assert outs[3].finish_reason == "length"


@pytest.mark.timeout(300)
def test_adopted_sequences_survive_preemption(models):
    """A decode cache of 14 blocks of 4 holds one of the longer sequences to its end but not
    two: adopted sequences that grow side by side are preempted and recomputed on the decode
    engine, tokens unchanged (against the colocated engine, whose cache holds them all)."""
    model_dir, _ = models("llama")
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    want = LLM(model_dir, layout="TP1", block_size=4).generate(PROMPTS, params, timeout_s=240)
    outs = LLM(model_dir, prefill="TP1", decode="TP1", block_size=4, num_blocks=14,
               max_model_len=48).generate(PROMPTS, params, timeout_s=240)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert [o.metrics["prefilled_on"] for o in outs] == ["prefill"] * len(PROMPTS)
    assert sum(o.metrics["preemptions"] for o in outs) > 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_disagg_prints_identical_tokens_and_the_analytic_bytes(models):
    model_dir, _ = models("llama")
    cmd = [sys.executable, "-m", "atoll", "bench", "disagg", "--model", str(model_dir), "--requests", "3",
           "--prompt-len", "20", "--output-len", "3", "--json"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["identical"]
    sent = [r["kv_mib"] for r in report["runs"].values()]
    assert sent[0] == 0 and sent[1] == pytest.approx(report["analytic_kv_mib"])


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc").exists(), reason="reads the process table from /proc")
@pytest.mark.parametrize("victim,engine", [(0, "prefill"), (1, "decode")])
def test_killing_a_rank_names_the_engine_and_fails_its_requests(models, tmp_path, victim, engine):
    """A killed prefill engine fails no request: the one whose KV it was sending moves with its
    first token to the decode engine, which prefills the rest itself. A killed decode engine,
    the only one, fails every request."""
    model_dir, _ = models("llama")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt_token_ids": [(i * 13 + j) % 300 + 1 for j in range(40)]})
                               + "\n" for i in range(12)))
    # decode one request at a time, 200 tokens each: the prefill rank waits on its sends for long
    cmd = [sys.executable, "-m", "atoll", "generate", "--model", str(model_dir), "--prompts", str(prompts),
           "--prefill", "TP1", "--decode", "TP1", "--max-new-tokens", "200", "--max-num-seqs", "1",
           "--output", str(tmp_path / "out.jsonl"), "--no-progress"]
    log = tmp_path / "err.txt"
    with open(log, "w") as err_file:
        proc = subprocess.Popen(cmd, stderr=err_file, stdout=subprocess.DEVNULL, text=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        try:
            deadline = time.monotonic() + 120
            while log.read_text().count("KV cache:") < 2 and time.monotonic() < deadline and proc.poll() is None:
                time.sleep(0.2)  # both engines loaded
            workers = spawned_children(proc.pid)
            assert len(workers) == 2, f"expected 2 rank processes, found {workers}"
            time.sleep(1.0)
            assert proc.poll() is None, "the job finished before the kill; make it longer"
            os.kill(workers[victim], signal.SIGKILL)  # ranks are spawned in order: 0 prefill, 1 decode
            proc.wait(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
    err = log.read_text()
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == list(range(12))  # every request written: done, or failed
    failed = [r for r in rows if "error" in r]
    done = [r for r in rows if "error" not in r]
    if engine == "decode":  # the only decode engine: every request still running failed
        assert failed
    else:  # the request whose KV it was sending moved on; the decode engine prefilled the rest itself
        assert not failed and "the other engines go on without it" in err, (failed, err)
    assert all(f"{engine} engine rank 0" in r["error"] for r in failed), [r["error"] for r in failed]
    assert f"{engine} engine rank 0 (job rank {victim}" in err and "killed by SIGKILL" in err, err
    assert "Traceback" not in err
    assert proc.returncode == (2 if failed else 0), err
    # the survivors' tokens are transformers' greedy ones (EOS may end one early)
    by_id = {i: [(i * 13 + j) % 300 + 1 for j in range(40)] for i in range(12)}
    want = reference_tokens(model_dir, [by_id[r["id"]] for r in done], 200)
    for r, w in zip(done, want):
        assert r["finish_reason"] in ("length", "stop"), r
        n = len(r["token_ids"])
        assert r["token_ids"] == w[:n] and (n == 200 or r["finish_reason"] == "stop"), (r["id"], r["token_ids"], w)


@pytest.mark.timeout(300)
def test_seeded_sampling_continues_the_prefill_engines_stream(models):
    """PP2 prefill: the last stage samples, and its generator state travels with the header."""
    model_dir, _ = models("llama")
    params = [SamplingParams(max_tokens=NEW, temperature=0.9, seed=100 + i, ignore_eos=True)
              for i in range(len(PROMPTS))]
    want = LLM(model_dir, layout="TP1", block_size=4).generate(PROMPTS, params, timeout_s=240)
    outs = LLM(model_dir, prefill="PP2", decode="TP1", block_size=4).generate(PROMPTS, params, timeout_s=240)
    assert [o.token_ids for o in outs] == [o.token_ids for o in want]
    assert [o.metrics["prefilled_on"] for o in outs] == ["prefill"] * len(PROMPTS)


def test_a_failed_job_rank_is_named_by_engine_and_its_rank_there():
    from atoll.engine.driver.disagg_faults import EngineFailure
    from atoll.errors import RankFailure
    from atoll.parallel.parts import engine_of

    layouts = [Layout.parse("TP2"), Layout.parse("TP2PP2")]
    assert [engine_of(layouts, r) for r in (0, 1, 2, 5)] == [(0, 0), (0, 1), (1, 0), (1, 3)]
    e = EngineFailure("decode engine", 3, RankFailure(5, "killed by SIGKILL", node="vm"))
    assert str(e) == "decode engine rank 3 (job rank 5 on vm) failed: killed by SIGKILL" and e.rank == 5


def test_disaggregation_options_are_checked_before_any_rank_starts(models):
    from atoll.config import EngineConfig
    from atoll.errors import AtollError, InputError

    with pytest.raises(InputError, match="--prefill and --decode together"):
        EngineConfig(prefill="TP2")
    with pytest.raises(InputError, match="disagg_min_prompt_tokens=-1"):
        EngineConfig(prefill="TP1", decode="TP1", disagg_min_prompt_tokens=-1)
    model_dir, _ = models("llama")
    with pytest.raises(InputError, match="not both"):
        LLM(model_dir, layout="TP2", prefill="TP1", decode="TP1")
    with pytest.raises(InputError, match="one replica"):
        LLM(model_dir, prefill="DP2", decode="TP1")
    with pytest.raises(AtollError, match="tp=3"):
        LLM(model_dir, prefill="TP3", decode="TP1")
