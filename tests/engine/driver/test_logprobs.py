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
