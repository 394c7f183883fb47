"""The compiled decode step (engine.step.compiled): the same greedy tokens as the eager step and as
transformers, one graph per sequence bucket that a second run does not recompile, and
--enforce-eager / ATOLL_ENFORCE_EAGER=1 compiling nothing; the default policy (auto,
engine.step.policy) end to end: eager for a short job without a record, compiled once the
record says the job repays it. The suite runs eager by default (conftest sets
ATOLL_COMPILE=never); these tests set their own policy."""

import argparse
import json

import pytest
import torch
from reference import reference_tokens

from atoll import LLM, SamplingParams
from atoll.engine.step import policy as step_policy
from atoll.engine.batch.shape import block_bucket, seq_buckets
from atoll.config import EngineConfig, add_cli_options, from_args
from atoll.engine.rank.loop import run_batch
from atoll.engine.rank.runner import ModelRunner
from atoll.errors import InputError
from atoll.launch.local import run_local
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext

# at max_num_seqs=4 (buckets 2, 4) the decode batches hold 4, then 3 (bucket 4 with a
# padding row where a sequence was a step before), then 1 sequence (bucket 2): two buckets,
# one graph. Under PP2 each of the two lanes decodes 2, then 1: bucket 2 only.
PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8], [250, 17]]
MAX_TOKENS = [3, 6, 6, 10]
NEW = max(MAX_TOKENS)


def _tokens(results):
    return [r["token_ids"] for r in results]


def _requests(llm):
    return llm.prepare(PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS])


def _eager_then_compiled_twice(rank, world, spec, requests):
    """On one runner: eager tokens, then compiled tokens twice; how far the compiled run's
    KV cache is from the eager run's (the same blocks hold the same positions), dynamo's graph
    count after each compiled run, and the buckets compiled."""
    from torch._dynamo.utils import counters

    ctx = ParallelContext.create(Layout.parse(spec.layout), rank) if world > 1 else ParallelContext.single()
    runner = ModelRunner(spec, ctx)
    step, runner.decode_step = runner.decode_step, None
    eager = _tokens(run_batch(runner, requests))
    kv = runner.cache.k + runner.cache.v
    eager_kv = [t[:runner.num_blocks].clone() for t in kv]  # the scratch block past them differs
    runner.decode_step = step
    first = _tokens(run_batch(runner, requests))
    kv_diff = max(float((t[:runner.num_blocks] - e).abs().max()) for t, e in zip(kv, eager_kv))
    graphs_first = counters["stats"]["unique_graphs"]
    second = _tokens(run_batch(runner, requests))
    return {"eager": eager, "first": first, "second": second, "kv_diff": kv_diff, "graphs_first": graphs_first,
            "graphs_second": counters["stats"]["unique_graphs"], "buckets": step.buckets_run,
            "compiles": len(step.compiles), "freezing": step.freezing, "last_stage": ctx.is_last_stage}


@pytest.fixture(scope="module")
def model_and_reference(tiny_model):
    d = tiny_model("llama", num_hidden_layers=2)
    return d, [t[:n] for t, n in zip(reference_tokens(d, PROMPTS, NEW), MAX_TOKENS)]


@pytest.fixture
def compiling(monkeypatch, tmp_path):
    """The ranks compile at once (--compile always over the suite's never),
    caching in tmp_path."""
    monkeypatch.delenv("ATOLL_ENFORCE_EAGER", raising=False)
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)
    monkeypatch.setenv("ATOLL_CACHE", str(tmp_path))
    monkeypatch.setenv("ATOLL_COMPILE", "always")
    return monkeypatch


# TP1 with weights packed for oneDNN, the CPU default; TP2 traces the all_reduce and
# all_gather into the graph over gloo; PP2 compiles each stage, send/recv outside
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,freezing,buckets", [("TP1", "1", [2, 4]), pytest.param("TP2", "0", [2, 4], marks=pytest.mark.slow),
                                                    pytest.param("PP2", "0", [2], marks=pytest.mark.slow)])
def test_compiled_tokens_match_eager_and_transformers(model_and_reference, compiling, layout, freezing, buckets):
    compiling.setenv("ATOLL_COMPILE_FREEZING", freezing)
    model_dir, expected = model_and_reference
    llm = LLM(model_dir, layout=layout, max_num_seqs=4, block_size=4)
    requests = _requests(llm)
    ranks = run_local(_eager_then_compiled_twice, llm.layout.world_size, llm.spec(requests), requests,
                      timeout_s=220)
    for r in ranks:
        assert r["eager"] == expected
        assert r["first"] == expected and r["second"] == expected
        assert r["kv_diff"] < 1e-4  # padding rows wrote no real sequence's slot
        assert r["buckets"] == buckets  # every decode batch ran compiled
        assert r["freezing"] is (freezing == "1")
        # one graph for every bucket and context length (sequences and blocks are symbolic), and
        # on the last stage one for the LM head...
        assert r["graphs_first"] == (2 if r["last_stage"] else 1), r
        assert r["graphs_second"] == r["graphs_first"]  # ...and the same shapes again compile nothing
        assert r["compiles"] == 1


def _runs_with_default_policy(rank, world, spec, requests):
    runner = ModelRunner(spec, ParallelContext.single())
    tokens = _tokens(run_batch(runner, requests))
    step = runner.decode_step
    return {"tokens": tokens, "step": None if step is None else type(step).__name__,
            "buckets": None if step is None else step.buckets_run}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_default_policy_compiles_when_the_record_says_it_repays(model_and_reference, compiling, tmp_path):
    """auto, end to end: a short job without a record decodes eagerly (plain: too short to tune
    its products) and records that step apart from the tuned eager step the policy weighs; with
    a record whose steps repay the compile, the same job compiles; both give transformers'
    tokens."""
    compiling.delenv("ATOLL_COMPILE")  # the default: auto
    model_dir, expected = model_and_reference
    llm = LLM(model_dir, max_num_seqs=4, block_size=4)
    assert llm.options.compile == "auto"
    requests = _requests(llm)
    spec = llm.spec(requests)
    assert spec.decode_steps == 6  # (2 + 5 + 5 + 9) tokens after the first, 4 at a time
    r = run_local(_runs_with_default_policy, 1, spec, requests, timeout_s=100)[0]
    assert r == {"tokens": expected, "step": None, "buckets": None}  # ~20 s of compiling would not repay
    record = tmp_path / step_policy.RECORD
    (key, entry), = json.loads(record.read_text()).items()
    assert entry["plain_step_s"] > 0 and "eager_step_s" not in entry and "cold_s" not in entry
    entry["eager_step_s"], entry["compiled_step_s"] = 10.0, 0.001  # 6 steps now save ~60 s
    record.write_text(json.dumps({key: entry}))
    r = run_local(_runs_with_default_policy, 1, spec, requests, timeout_s=280)[0]
    assert r == {"tokens": expected, "step": "CompiledDecode", "buckets": [2, 4]}
    entry = json.loads(record.read_text())[key]
    assert entry["cold_s"] > 0 and entry["compiled_step_s"] < 10.0


def test_policy_weighs_steps_against_the_compile():
    est = step_policy.expected({}, layers=30, weight_bytes=540_000_000)
    assert est["compile_s"] == pytest.approx(16.5) and est["measured"] == []  # 12 s + 0.15 s a layer
    assert est["eager_step_s"] == pytest.approx(0.054) and est["compiled_step_s"] == pytest.approx(0.045)
    # a step saves 9 ms, and 5% of its 54 ms eager time may go too: 1,410 steps come to 16.497 s < 16.5 s
    assert not step_policy.repays(15, est) and not step_policy.repays(1410, est)
    assert step_policy.repays(1411, est) and step_policy.repays(None, est)  # unknown work: compile
    cold = {"cold_s": 60.0, "eager_step_s": 0.11, "compiled_step_s": 0.045}
    warm = step_policy.expected(cold, layers=30, weight_bytes=0)
    assert warm["compile_s"] == pytest.approx(30.0)  # compiled once: inductor's cache holds it
    assert step_policy.repays(430, warm) and not step_policy.repays(420, warm)  # 70.5 ms a step against 30 s
    gone = step_policy.expected(cold | {"warm_s": 5.0}, layers=30, weight_bytes=0, cached=False)
    assert gone["compile_s"] == 60.0  # the cache was cleared: a cold compile again
    assert step_policy.expected(cold | {"warm_s": 5.0}, layers=30, weight_bytes=0)["compile_s"] == 5.0


def test_compile_policy_is_a_cli_choice_and_an_env_variable():
    from atoll.config import resolve

    parser = argparse.ArgumentParser()
    add_cli_options(parser)
    assert from_args(parser.parse_args(["--compile", "always"])).compile == "always"
    assert from_args(parser.parse_args([])).compile == "auto"
    assert resolve(environ={"ATOLL_COMPILE": "Never"}).compile == "never"
    with pytest.raises(InputError, match=r"^compile 'soon' is not one of auto, always, never$"):
        EngineConfig(compile="soon")


def _runs_eagerly(rank, world, spec, requests):
    from torch._dynamo.utils import counters

    runner = ModelRunner(spec, ParallelContext.single())
    tokens = _tokens(run_batch(runner, requests))
    return runner.decode_step, tokens, dict(counters["stats"])


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_one_sequence_graph_matches_transformers(model_and_reference, compiling):
    """max_num_seqs=1: one static one-row graph whose linears are row reductions, and the LM
    head's."""
    compiling.setenv("ATOLL_COMPILE_FREEZING", "1")
    model_dir, expected = model_and_reference
    llm = LLM(model_dir, layout="TP1", max_num_seqs=1, block_size=4)
    requests = _requests(llm)
    r = run_local(_eager_then_compiled_twice, 1, llm.spec(requests), requests, timeout_s=220)[0]
    assert r["eager"] == expected and r["first"] == expected and r["second"] == expected
    assert r["buckets"] == [1] and r["graphs_first"] == r["graphs_second"] == 2 and r["compiles"] == 1


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_cached_graph_serves_an_engine_of_more_rows(model_and_reference, compiling):
    """Two engines sharing inductor's cache, the second with four times the rows (max_num_seqs 2
    then 8, each with a verify step's 1 + 3 rows a sequence): the second takes the first's cached
    graphs and still gives transformers' tokens, where a graph cached for the first's row range
    failed its guards (ConstraintViolationError) before."""
    model_dir, expected = model_and_reference
    for seqs in (2, 8):
        llm = LLM(model_dir, layout="TP1", max_num_seqs=seqs, block_size=4,
                  speculative_config={"method": "ngram", "num_speculative_tokens": 3})
        requests = _requests(llm)
        r = run_local(_eager_then_compiled_twice, 1, llm.spec(requests), requests, timeout_s=220)[0]
        assert r["first"] == expected and r["second"] == expected and r["compiles"] == 1, (seqs, r)


def test_row_product_is_linear():
    from atoll.layers.packed import row_product

    g = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(*s, generator=g) for s in ((1, 96), (40, 96), (40,)))
    torch.testing.assert_close(row_product(x, w), torch.nn.functional.linear(x, w), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(row_product(x, w, b), torch.nn.functional.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("how", ["option", "env"])
def test_enforce_eager_compiles_nothing(model_and_reference, compiling, how):
    model_dir, expected = model_and_reference
    if how == "env":
        compiling.setenv("ATOLL_ENFORCE_EAGER", "1")
    # an explicit keyword wins over the environment, so the env case passes none
    llm = LLM(model_dir, max_num_seqs=4, block_size=4, **({"enforce_eager": True} if how == "option" else {}))
    requests = _requests(llm)
    step, tokens, stats = run_local(_runs_eagerly, 1, llm.spec(requests), requests, timeout_s=100)[0]
    assert step is None and tokens == expected
    assert not stats.get("unique_graphs") and not stats.get("calls_captured")  # dynamo never ran


def test_enforce_eager_is_a_cli_switch_and_a_keyword():
    parser = argparse.ArgumentParser()
    add_cli_options(parser)
    assert from_args(parser.parse_args(["--enforce-eager"])).enforce_eager is True
    assert from_args(parser.parse_args([])).enforce_eager is False
    assert "no torch.compile" in parser.format_help()
    with pytest.raises(InputError, match=r"^enforce_eager='yes' must be True or False$"):
        EngineConfig(enforce_eager="yes")


def test_buckets():
    assert seq_buckets(1) == [1] and seq_buckets(1, smallest=2) == [2]
    assert seq_buckets(16) == [1, 2, 4, 8, 16] and seq_buckets(16, smallest=2) == [2, 4, 8, 16]
    assert seq_buckets(20, smallest=2) == [2, 4, 8, 16, 20]
    assert [block_bucket(b, 128) for b in (1, 2, 3, 5, 9, 100)] == [2, 2, 4, 8, 16, 128]
    assert block_bucket(5, 6) == 6 and block_bucket(1, 1) == 1
