"""The compiled decode step (engine.compiled): the same greedy tokens as the eager step and as
transformers, one graph per sequence bucket that a second run does not recompile, and
--enforce-eager / ATOLL_ENFORCE_EAGER=1 compiling nothing. The suite runs eager by default
(conftest sets ATOLL_ENFORCE_EAGER=1); these tests lift it."""

import argparse

import pytest
import torch
from reference import reference_tokens

from atoll import LLM, SamplingParams
from atoll.engine.compiled import block_bucket, seq_buckets
from atoll.config import EngineConfig, add_cli_options, from_args
from atoll.engine.generate import run_requests
from atoll.engine.runner import ModelRunner
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
    eager = _tokens(run_requests(runner, requests))
    kv = runner.cache.k + runner.cache.v
    eager_kv = [t[:runner.num_blocks].clone() for t in kv]  # the scratch block past them differs
    runner.decode_step = step
    first = _tokens(run_requests(runner, requests))
    kv_diff = max(float((t[:runner.num_blocks] - e).abs().max()) for t, e in zip(kv, eager_kv))
    graphs_first = counters["stats"]["unique_graphs"]
    second = _tokens(run_requests(runner, requests))
    return {"eager": eager, "first": first, "second": second, "kv_diff": kv_diff, "graphs_first": graphs_first,
            "graphs_second": counters["stats"]["unique_graphs"], "buckets": step.buckets_run,
            "compiles": len(step.compiles), "freezing": step.freezing}


@pytest.fixture(scope="module")
def model_and_reference(tiny_model):
    d = tiny_model("llama", num_hidden_layers=2)
    return d, [t[:n] for t, n in zip(reference_tokens(d, PROMPTS, NEW), MAX_TOKENS)]


@pytest.fixture
def compiling(monkeypatch, tmp_path):
    """The ranks compile (conftest's ATOLL_ENFORCE_EAGER lifted), caching in tmp_path."""
    monkeypatch.delenv("ATOLL_ENFORCE_EAGER", raising=False)
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    return monkeypatch


# TP1 with frozen (MKL-prepacked) weights, the CPU default; TP2 traces the all_reduce and
# all_gather into the graph over gloo; PP2 compiles each stage, send/recv outside
@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout,freezing,buckets", [("TP1", "1", [2, 4]), ("TP2", "0", [2, 4]),
                                                    ("PP2", "0", [2])])
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
        # one graph for every bucket and context length (sequences and blocks are symbolic)...
        assert r["graphs_first"] == 1, r
        assert r["graphs_second"] == r["graphs_first"]  # ...and the same shapes again compile nothing
        assert r["compiles"] == 1


def _runs_eagerly(rank, world, spec, requests):
    from torch._dynamo.utils import counters

    runner = ModelRunner(spec, ParallelContext.single())
    tokens = _tokens(run_requests(runner, requests))
    return runner.decode_step, tokens, dict(counters["stats"])


@pytest.mark.timeout(240)
def test_one_sequence_graph_matches_transformers(model_and_reference, compiling):
    """max_num_seqs=1: one static one-row graph whose linears are row reductions."""
    compiling.setenv("ATOLL_COMPILE_FREEZING", "1")
    model_dir, expected = model_and_reference
    llm = LLM(model_dir, layout="TP1", max_num_seqs=1, block_size=4)
    requests = _requests(llm)
    r = run_local(_eager_then_compiled_twice, 1, llm.spec(requests), requests, timeout_s=220)[0]
    assert r["eager"] == expected and r["first"] == expected and r["second"] == expected
    assert r["buckets"] == [1] and r["graphs_first"] == r["graphs_second"] == 1 and r["compiles"] == 1


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
    llm = LLM(model_dir, max_num_seqs=4, block_size=4, enforce_eager=how == "option")
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
