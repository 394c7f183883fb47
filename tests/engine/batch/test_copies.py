"""n > 1: a request's copies compute its prompt once (the first copy's; the others fork from
its blocks, the partly filled last one copied) and each draws from its own seed stream,
seed + i. With top_k=1 every copy draws greedy's tokens, so a wrong copied block shows as
tokens that differ from transformers'."""

from dataclasses import replace

import pytest
from reference import reference_tokens

from atoll import LLM, SamplingParams
from atoll.engine.batch.copies import expand
from atoll.engine.rank.core import EngineCore
from atoll.engine.rank.loop import run_batch
from atoll.engine.rank.runner import ModelRunner
from atoll.parallel.mesh import ParallelContext

NEW = 6
PROMPTS = [list(range(5, 26)), [100, 3, 8, 100, 3, 9, 9, 9]]  # 21 tokens: a block and a part of 16
GREEDY_COPIES = SamplingParams(max_tokens=NEW, ignore_eos=True, n=4, temperature=1.0, top_k=1)


@pytest.fixture(scope="module")
def models(tiny_model):
    """kind -> (model dir, transformers' greedy tokens), each built once."""
    cache = {}

    def get(kind):
        if kind not in cache:
            d = tiny_model(kind, num_hidden_layers=2)
            cache[kind] = (d, reference_tokens(d, PROMPTS, NEW))
        return cache[kind]
    return get


@pytest.fixture(scope="module")
def dense(models):
    return models("llama")


def computed(out) -> int:
    """Prompt tokens the engine computed for a request's copies: prompt less cached, summed."""
    return sum(c.metrics["prompt_tokens"] - c.metrics["cached_tokens"] for c in out.outputs)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,layout", [("llama", "TP1"), ("llama", "TP2"), ("llama", "PP2"),
                                         ("qwen3_moe", "DP2EP2")])
def test_copies_share_the_prompt_and_draw_greedy_with_top_k_1(models, kind, layout):
    """Under DP2 each request's copies run on its first copy's replica, and the replicas agree
    on the width of the tokens they hand round."""
    d, expected = models(kind)
    with LLM(d, layout=layout) as llm:
        outs = llm.generate(PROMPTS, GREEDY_COPIES)
    for prompt, out, want in zip(PROMPTS, outs, expected):
        assert [c.token_ids for c in out.outputs] == [want] * 4
        assert computed(out) == len(prompt)  # the prompt was computed once, for the first copy
        assert [c.metrics["cached_tokens"] for c in out.outputs] == [0] + [len(prompt)] * 3


@pytest.mark.timeout(300)
def test_seeded_copies_reproduce_and_differ(dense):
    d, _ = dense
    sampled = SamplingParams(max_tokens=NEW, ignore_eos=True, n=4, temperature=1.0, seed=11)
    with LLM(d, layout="TP1") as llm:
        a, b = (llm.generate(PROMPTS, sampled) for _ in range(2))
        alone = [llm.generate(PROMPTS, replace(sampled, n=1, seed=11 + i)) for i in range(4)]
        unseeded = llm.generate(PROMPTS, replace(sampled, seed=None))
    for k in range(len(PROMPTS)):
        copies = [c.token_ids for c in a[k].outputs]
        assert copies == [c.token_ids for c in b[k].outputs]  # run to run
        assert len({tuple(c) for c in copies}) == 4  # 24 draws from 301 tokens: the copies differ
        assert copies == [alone[i][k].token_ids for i in range(4)]  # copy i draws as seed + i alone does
        assert a[k].token_ids == copies[0] and a[k].text is None  # the first copy's, on the output itself
        assert len({tuple(c.token_ids) for c in unseeded[k].outputs}) == 4
        assert computed(a[k]) == len(PROMPTS[k])


def _runner(d, **options):
    llm = LLM(d, **options)
    return llm, ModelRunner(llm.spec(llm.prepare(PROMPTS, GREEDY_COPIES)), ParallelContext.single())


def _engine_requests(llm):
    ids = iter(range(100))
    return expand(llm.prepare(PROMPTS, GREEDY_COPIES), lambda: next(ids))[0]


@pytest.mark.timeout(300)
def test_copies_past_max_num_seqs_wait_and_find_the_prefix(dense):
    """With room for three sequences beside the two first copies, one copy forks and the rest
    wait: they find the prompt's full blocks cached (the 8-token prompt has none) and compute
    its last part; every block comes back."""
    d, expected = dense
    llm, runner = _runner(d, max_num_seqs=3, num_blocks=64)
    results = run_batch(runner, _engine_requests(llm))
    assert [r["token_ids"] for r in results] == [w for w in expected for _ in range(4)]
    assert [r["metrics"]["cached_tokens"] for r in results] == [0, 21, 16, 16, 0, 0, 0, 0]
    assert runner.stats["blocks_held"] == 0


@pytest.mark.timeout(300)
def test_a_leader_aborted_before_its_prompt_hands_its_copies_on(dense):
    d, expected = dense
    llm, runner = _runner(d)
    requests = _engine_requests(llm)[:4]
    core = EngineCore(runner)
    runner.start_run()
    for req in requests:
        core.add(req)
    assert core.abort(requests[0].index)
    core.abort(requests[2].index)  # a parked copy leaves too
    while core.busy:
        core.step()
    assert [core.results[r.index]["finish_reason"] for r in requests] == ["abort", "length", "abort", "length"]
    assert core.results[requests[1].index]["token_ids"] == core.results[requests[3].index]["token_ids"] == expected[0]
    assert core.results[requests[3].index]["metrics"]["cached_tokens"] == 21  # forked from the new leader
    assert core.blocks_in_use() == 0
