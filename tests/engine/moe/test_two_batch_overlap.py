"""Two-batch overlap (engine/step/two_batch.py): transformers' greedy tokens with TBO forced on
(threshold 2, so every prefill and decode step of two or more sequences splits), at EP2 and
DP2EP2, for Qwen3-MoE and DeepSeek-V3 (MLA), through the engine's rank loop; on the gather
exchange (the default at these sizes) and the all-to-all, under PP (EP2PP2) and with the
island-first dispatch (EP4 over two islands); and the split and the interleave's order without
processes."""

import pytest
from reference import reference_cache

from atoll import LLM, SamplingParams
from atoll.engine.rank.loop import run_batch
from atoll.engine.rank.runner import ModelRunner
from atoll.engine.step.two_batch import interleave, split_at
from atoll.errors import InputError
from atoll.launch.local import run_local
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ContextOptions, ParallelContext

PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8], [250, 17, 4], [9, 9, 8]]
NEW = 8
FAMILIES = {"qwen3_moe": ("qwen3_moe", dict(num_experts=8)),
            "deepseek_v3": ("deepseek_v3", dict(n_routed_experts=8, num_experts_per_tok=2))}


@pytest.fixture(scope="module")
def references(tiny_model):
    return reference_cache(tiny_model, FAMILIES, PROMPTS, NEW)


def _rank(rank: int, world: int, spec, requests, options=None) -> dict:
    runner = ModelRunner(spec, ParallelContext.create(Layout.parse(spec.layout), rank, options=options))
    results = run_batch(runner, requests)
    tokens = [r["token_ids"] if r is not None else None for r in results]
    return {"tokens": tokens, "two_batch": runner.stats["two_batch"], "worked": runner.stats["worked"]}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,layout,exchange", [("qwen3_moe", "EP2", "auto"), ("qwen3_moe", "DP2EP2", "auto"),
                                                    ("deepseek_v3", "EP2", "auto"),
                                                    ("deepseek_v3", "DP2EP2", "auto"),
                                                    ("qwen3_moe", "DP2EP2", "alltoall"),
                                                    ("deepseek_v3", "EP2", "alltoall"), ("qwen3_moe", "EP2PP2", "auto")])
def test_tokens_match_transformers_with_two_batch_overlap(references, family, layout, exchange):
    model_dir, expected = references(family)
    llm = LLM(model_dir, layout=layout, enable_two_batch_overlap=True, tbo_token_threshold=2,
              moe_exchange=exchange, enable_prefix_caching=False)
    requests = llm.prepare(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    ranks = run_local(_rank, Layout.parse(layout).world_size, llm.spec(requests), requests, timeout_s=240)
    assert ranks[0]["tokens"] == expected
    # every step had >= 2 tokens on some replica, so each split: prefill, then every decode step
    assert all(r["two_batch"] == r["worked"] and r["worked"] >= NEW for r in ranks)


@pytest.mark.timeout(300)
def test_island_first_dispatch_with_two_batch_overlap(references):
    """EP4 over two islands of two ranks, the all-to-all island first (its two legs in turn,
    each half's under the other's work as a whole)."""
    model_dir, expected = references("qwen3_moe")
    llm = LLM(model_dir, layout="EP4", enable_two_batch_overlap=True, tbo_token_threshold=2,
              moe_exchange="alltoall", dispatch="hierarchical", enable_prefix_caching=False)
    requests = llm.prepare(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    ranks = run_local(_rank, 4, llm.spec(requests), requests, ContextOptions(islands=(0, 0, 1, 1)), timeout_s=240)
    assert ranks[0]["tokens"] == expected
    assert all(r["two_batch"] == r["worked"] and r["worked"] >= NEW for r in ranks)


def test_a_high_threshold_keeps_one_batch(references):
    """The same run, threshold above every step's tokens: no step splits (the switch by size)."""
    model_dir, expected = references("qwen3_moe")
    llm = LLM(model_dir, layout="EP2", enable_two_batch_overlap=True, tbo_token_threshold=10**6)
    requests = llm.prepare(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    ranks = run_local(_rank, 2, llm.spec(requests), requests, timeout_s=240)
    assert ranks[0]["tokens"] == expected and [r["two_batch"] for r in ranks] == [0, 0]


def test_split_halves_the_tokens():
    assert split_at([1, 1, 1, 1]) == 2
    assert split_at([5, 1, 1, 1]) == 1  # 5 | 3 beats 6 | 2
    assert split_at([1, 1, 1, 5]) == 3
    assert split_at([7]) == 1 and split_at([]) == 0  # one sequence: the second half is empty


def test_interleave_takes_turns():
    """Each generator runs until it yields (an exchange started), then the other: A's dispatch
    flies under B's attention, B's under A's experts."""
    log = []

    def steps(name, n):
        for i in range(n):
            log.append(f"{name}{i}")
            yield
        return name

    assert interleave(steps("a", 3), steps("b", 2)) == ("a", "b")
    assert log == ["a0", "b0", "a1", "b1", "a2"]


def test_threshold_is_checked():
    with pytest.raises(InputError, match="tbo_token_threshold=1 must be"):
        LLM("unused", tbo_token_threshold=1)
