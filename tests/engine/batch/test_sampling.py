"""Sampling: seeds reproduce, top-k/top-p cut the distribution, stop strings end requests."""

import pytest
import torch

from atoll import LLM, SamplingParams
from atoll.engine.sample.sampler import SamplerState, sample_one
from atoll.errors import InputError


def test_top_k_and_top_p_only_pick_allowed_tokens():
    logits = torch.tensor([5.0, 4.0, 3.0, 0.0, -1.0])
    picks = {int(sample_one(logits, SamplerState(SamplingParams(temperature=1.0, top_k=2, seed=s)))) for s in range(200)}
    assert picks == {0, 1}
    # softmax of these: token 0 holds ~0.66, 0+1 ~0.91; top_p=0.9 keeps tokens 0 and 1 only
    picks = {int(sample_one(logits, SamplerState(SamplingParams(temperature=1.0, top_p=0.9, seed=s)))) for s in range(200)}
    assert picks == {0, 1}


def test_bad_sampling_params_are_clear():
    with pytest.raises(InputError, match="top_p=1.5 must be in"):
        SamplingParams(top_p=1.5)
    with pytest.raises(InputError, match="max_tokens=0"):
        SamplingParams(max_tokens=0)


@pytest.mark.timeout(300)
def test_same_seed_same_tokens(tiny_model):
    llm = LLM(tiny_model("llama"), layout="TP2")
    prompts = [[5, 7, 9], [100, 3]]
    params = SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95, seed=7, ignore_eos=True)
    a = [o.token_ids for o in llm.generate(prompts, params)]
    b = [o.token_ids for o in llm.generate(prompts, params)]
    c = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=12, temperature=1.0, top_p=0.95,
                                                                    seed=8, ignore_eos=True))]
    assert a == b
    assert a != c  # 24 sampled tokens from a 301-token vocabulary: a new seed changes some


@pytest.mark.timeout(300)
def test_stop_string_ends_generation(smollm2_dir):
    llm = LLM(smollm2_dir, layout="TP1", max_model_len=256)
    question = ["What is the capital of France?"]
    full = llm.generate(question, SamplingParams(max_tokens=24), chat=True)[0]
    assert "Paris" in full.text
    cut = llm.generate(question, SamplingParams(max_tokens=24, stop=("Paris",)), chat=True)[0]
    assert cut.finish_reason == "stop"
    assert "Paris" not in cut.text and full.text.startswith(cut.text)
    assert len(cut.token_ids) < len(full.token_ids)
    assert cut.token_ids == full.token_ids[: len(cut.token_ids)]


def test_a_seeded_draw_depends_on_the_position_not_on_the_draws_before():
    """engine.sample.sampler.stream_seed: a request that goes on elsewhere (a migration) draws
    the same token at position j whatever was drawn before; another position or seed, another
    stream."""
    logits = torch.randn(301, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0, seed=5)
    a, b = SamplerState(params), SamplerState(params)
    for q in range(7):  # a's stream runs through positions 0..6 first
        sample_one(logits, a, q)
    draws_a = [int(sample_one(logits, a, q)) for q in range(7, 40)]
    draws_b = [int(sample_one(logits, b, q)) for q in range(7, 40)]  # b starts at 7, as after a migration
    assert draws_a == draws_b
    other = SamplerState(SamplingParams(temperature=1.0, seed=6))
    assert [int(sample_one(logits, other, q)) for q in range(7, 40)] != draws_a
    assert len(set(draws_a)) > 5  # positions draw from streams of their own, not one value
