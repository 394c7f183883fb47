"""MoE models: greedy tokens identical to transformers at every EP / TP / DP / PP layout."""

import pytest
from reference import reference_cache

from atoll import LLM, SamplingParams

PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8]]
NEW = 16
# EP2 is TP2EP2 (TP attention, moe_tp 1); TP4EP2 has moe_tp 2; DP2 puts pure TP experts over DP ranks
LAYOUTS = ["EP2", "EP4", "TP2", "DP2EP2", "EP2PP2", "TP4EP2", "DP2", "DP2PP2"]
# 5 experts: they do not divide evenly over 2 or 4 ranks
FAMILIES = {
    "mixtral": ("mixtral", dict(num_local_experts=5)),
    "qwen2_moe": ("qwen2_moe", dict(num_experts=5)),
    "qwen3_moe": ("qwen3_moe", dict(num_experts=5)),
}


@pytest.fixture(scope="module")
def references(tiny_model):
    return reference_cache(tiny_model, FAMILIES, PROMPTS, NEW)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("family", list(FAMILIES))
def test_moe_greedy_tokens_match_transformers(references, family, layout):
    model_dir, expected = references(family)
    outs = LLM(model_dir, layout=layout).generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
