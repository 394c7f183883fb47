"""Greedy tokens identical to transformers for every dense family and layout."""

import pytest
import torch

from reference import reference_cache, reference_tokens

from atoll import LLM, SamplingParams

PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8], [250]]
NEW = 16
LAYOUTS = ["TP1", "TP2", "TP4", "PP2", "PP3", "TP2PP2"]
FAMILIES = {
    "llama": ("llama", dict(num_hidden_layers=4)),  # 4 layers: PP3 splits them unevenly
    "qwen2": ("qwen2", dict(num_hidden_layers=4)),
    "qwen3": ("qwen3", dict(num_hidden_layers=4)),
    "mistral": ("mistral", dict(num_hidden_layers=4)),
    # tied embeddings and Llama 3.1's rope scaling in one model
    "llama3-tied": ("llama", dict(num_hidden_layers=4, tie_word_embeddings=True, rope_parameters=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
        high_freq_factor=4.0, original_max_position_embeddings=32))),
}


@pytest.fixture(scope="module")
def references(tiny_model):
    return reference_cache(tiny_model, FAMILIES, PROMPTS, NEW)


# the tied/llama3 variant runs at the layouts that split the embedding and the head
CASES = [(f, lay) for f in FAMILIES if f != "llama3-tied" for lay in LAYOUTS] + \
    [("llama3-tied", lay) for lay in ("TP2", "PP2", "TP2PP2")]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,layout", CASES)
def test_greedy_tokens_match_transformers(references, family, layout):
    model_dir, expected = references(family)
    outs = LLM(model_dir, layout=layout).generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected


SMOL_LAYOUTS = [pytest.param("TP3", marks=pytest.mark.slow), "PP2", pytest.param("TP3PP2", marks=pytest.mark.slow)]
CHAT = ["What is the capital of France?", "Name three colours.", "Write a haiku about rain."]


@pytest.fixture(scope="module")
def smol_reference(smollm2_dir):
    from atoll.engine.batch.tokenizer import Tokenizer

    tok = Tokenizer(smollm2_dir)
    prompts = [tok.encode_chat(t) for t in CHAT]
    return prompts, reference_tokens(smollm2_dir, prompts, NEW)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", SMOL_LAYOUTS)
def test_smollm2_matches_transformers(smollm2_dir, smol_reference, layout):
    prompts, expected = smol_reference
    outs = LLM(smollm2_dir, layout=layout).generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
