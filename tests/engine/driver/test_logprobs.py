"""Logprobs of sampled tokens and their likeliest alternatives: transformers' log_softmax of
the same positions, at layouts whose sampler is not the reporting rank (PP2) or sits in a
DP replica (DP2EP2)."""

import pytest
import torch

from atoll import LLM, SamplingParams
from atoll.errors import InputError

PROMPTS = [[5, 7, 9, 11, 13], [100, 3, 8], [42, 1]]
NEW, K = 4, 3


def reference_logprobs(model_dir, prompt, tokens):
    """transformers' log_softmax at each generated position: [NEW, vocab]."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,layout", [("llama", "TP1"), ("llama", "PP2"), ("llama", "TP2"),
                                         ("qwen3_moe", "DP2EP2")])
def test_logprobs_match_transformers(tiny_model, kind, layout):
    model_dir = tiny_model(kind, num_hidden_layers=2)
    asks = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=K)
    # two ask (under DP2 one on each replica), one does not
    params = [asks, asks, SamplingParams(max_tokens=NEW, ignore_eos=True)]
    with LLM(model_dir, layout=layout) as llm:
        outs = llm.generate(PROMPTS, params)
    assert outs[2].logprobs is None
    for prompt, out in zip(PROMPTS[:2], outs[:2]):
        assert len(out.logprobs) == NEW
        want = reference_logprobs(model_dir, prompt, out.token_ids)
        for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert entry["logprob"] == pytest.approx(float(want[step, token]), abs=1e-4)
            top = torch.topk(want[step], K)
            assert [i for i, _ in entry["top"]] == top.indices.tolist()
            assert [lp for _, lp in entry["top"]] == pytest.approx(top.values.tolist(), abs=1e-4)
            assert entry["top"][0][0] == token  # greedy: the sampled token is the likeliest


def test_logprobs_are_checked():
    with pytest.raises(InputError, match="logprobs=21"):
        SamplingParams(logprobs=21)
    with pytest.raises(InputError, match="logprobs=-1"):
        SamplingParams(logprobs=-1)
    assert SamplingParams(logprobs=0).logprobs == 0


def reference_prompt_logprobs(model_dir, prompt):
    """transformers' log_softmax at each prompt position but the last: row q scores token q + 1."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = ref(torch.tensor([prompt])).logits[0, :-1]
    return torch.log_softmax(logits.float(), dim=-1)


LONG = list(range(3, 43))  # 40 tokens: three chunks of a 16-token budget


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,layout", [("llama", "TP1"), ("llama", "PP2"), ("llama", "TP2"),
                                         ("qwen3_moe", "DP2EP2")])
def test_prompt_logprobs_match_transformers(tiny_model, kind, layout):
    """Each prompt token's log-probability, rank and likeliest alternatives, over a prompt
    prefilled in chunks, for a prompt the prefix cache already holds (prompt_logprobs skip the
    cache, as vLLM's do), and on a request's copies."""
    model_dir = tiny_model(kind, num_hidden_layers=2)
    asks = SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=K)
    prompts = [LONG, PROMPTS[1], LONG]
    params = [SamplingParams(max_tokens=2, ignore_eos=True), asks,
              SamplingParams(max_tokens=2, ignore_eos=True, prompt_logprobs=1, n=2, temperature=1.0, seed=1)]
    with LLM(model_dir, layout=layout, max_num_batched_tokens=16) as llm:
        first = llm.generate(prompts[:1], params[:1])  # LONG in the prefix cache
        outs = llm.generate(prompts, params)
    assert first[0].prompt_logprobs is None and outs[0].prompt_logprobs is None
    assert outs[2].outputs[1].prompt_logprobs == outs[2].prompt_logprobs  # the copy has its leader's
    for prompt, out, k in ((PROMPTS[1], outs[1], K), (LONG, outs[2], 1)):
        want = reference_prompt_logprobs(model_dir, prompt)
        assert out.prompt_logprobs[0] is None and len(out.prompt_logprobs) == len(prompt)
        for q, entry in enumerate(out.prompt_logprobs[1:]):
            token = prompt[q + 1]
            assert entry["token"] == token
            assert entry["logprob"] == pytest.approx(float(want[q, token]), abs=1e-4)
            assert entry["rank"] == 1 + int((want[q] > want[q, token]).sum())
            top = torch.topk(want[q], k)
            assert [i for i, _ in entry["top"]] == top.indices.tolist()
            assert [lp for _, lp in entry["top"]] == pytest.approx(top.values.tolist(), abs=1e-4)


def _check_against_transformers(model_dir, prompts, outs, k):
    for prompt, out in zip(prompts, outs):
        want = reference_logprobs(model_dir, prompt, out.token_ids)
        assert len(out.logprobs) == len(out.token_ids)
        for step, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
            assert entry["logprob"] == pytest.approx(float(want[step, token]), abs=1e-4)
            assert [i for i, _ in entry["top"]] == torch.topk(want[step], k).indices.tolist()


@pytest.mark.timeout(300)
def test_logprobs_beside_speculation(tiny_model):
    """A request that asks for logprobs drafts nothing and gets transformers' logprobs, while
    the one beside it in the batch drafts (and still gives greedy's tokens)."""
    model_dir = tiny_model("llama", num_hidden_layers=2)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    prompts = [[5, 7, 9, 5, 7, 9, 5, 7], [5, 7, 9, 5, 7, 9, 5, 7]]
    params = [SamplingParams(max_tokens=8, ignore_eos=True, logprobs=K), SamplingParams(max_tokens=8, ignore_eos=True)]
    with LLM(model_dir, layout="TP1", speculative_config=spec) as llm:
        outs = llm.generate(prompts, params)
    assert outs[0].token_ids == outs[1].token_ids
    assert outs[0].metrics["spec_drafted"] == 0 < outs[1].metrics["spec_drafted"]
    _check_against_transformers(model_dir, prompts[:1], outs[:1], K)


@pytest.mark.timeout(300)
def test_logprobs_and_prompt_logprobs_when_disaggregated(tiny_model):
    """The first token (and the prompt's logprobs) come from the prefill engine, the rest from
    the decode engine; short prompts stay on the decode engine."""
    model_dir = tiny_model("llama", num_hidden_layers=2)
    prompts = [LONG, PROMPTS[1]]
    params = SamplingParams(max_tokens=NEW, ignore_eos=True, logprobs=K, prompt_logprobs=1)
    with LLM(model_dir, prefill="TP1", decode="TP1", block_size=4, disagg_min_prompt_tokens=12) as llm:
        outs = llm.generate(prompts, params)
    assert [o.metrics["prefilled_on"] for o in outs] == ["prefill", "decode"]
    _check_against_transformers(model_dir, prompts, outs, K)
    for prompt, out in zip(prompts, outs):
        want = reference_prompt_logprobs(model_dir, prompt)
        assert [e["logprob"] for e in out.prompt_logprobs[1:]] == pytest.approx(
            [float(want[q, prompt[q + 1]]) for q in range(len(prompt) - 1)], abs=1e-4)
