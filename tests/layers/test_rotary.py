"""Rotary frequencies for each scaling type against transformers' own."""

import pytest
import torch
from transformers import LlamaConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from atoll.errors import ConfigError
from atoll.layers.rotary import rope_frequencies
from atoll.models.config import ModelConfig

CASES = [
    dict(rope_type="linear", rope_theta=10000.0, factor=2.0),
    dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
         original_max_position_embeddings=64),
    dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64),
    dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
         beta_fast=16, beta_slow=2, attention_factor=1.3),
]


@pytest.mark.parametrize("params", CASES, ids=lambda p: p["rope_type"])
def test_frequencies_match_transformers(params):
    hf = LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=256,
                     rope_parameters=dict(params))
    want_inv, want_scale = ROPE_INIT_FUNCTIONS[params["rope_type"]](hf, "cpu")
    cfg = ModelConfig.from_dict(hf.to_dict())
    inv, scale = rope_frequencies(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
    assert torch.allclose(inv, want_inv.float(), rtol=1e-6, atol=0)
    assert scale == pytest.approx(want_scale)


def test_unknown_scaling_is_a_clear_error():
    with pytest.raises(ConfigError, match="'longrope' is not supported; supported: default, linear"):
        rope_frequencies(16, 10000.0, {"rope_type": "longrope"}, 256)


def test_rotary_on_q_and_k_of_one_qkv_buffer_equals_separate_tensors():
    from atoll.kernels.reference import _joined, rotary_

    g = torch.Generator().manual_seed(0)
    half = lambda x: torch.cat((-x[..., 4:], x[..., :4]), dim=-1)  # noqa: E731  rotate_half
    for tokens in (1, 6):
        qkv = torch.randn(tokens, (4 + 2 + 2) * 8, generator=g)
        q, k, v = (t.view(tokens, -1, 8) for t in qkv.split([32, 16, 16], dim=-1))
        assert len(_joined(q, k)) == 1  # rotated as one view
        cos, sin = torch.randn(tokens, 8, generator=g), torch.randn(tokens, 8, generator=g)
        q_in, k_in, v_in = q.clone(), k.clone(), v.clone()
        q_alone, k_alone = q.clone(), k.clone()
        assert len(_joined(q_alone, k_alone)) == 2
        rotary_(q_alone, k_alone, cos, sin)
        rotary_(q, k, cos, sin)
        assert torch.equal(q, q_alone) and torch.equal(k, k_alone) and torch.equal(v, v_in)
        c, s = cos[:, None], sin[:, None]  # the textbook formula, bit for bit
        assert torch.equal(q, q_in * c + half(q_in) * s) and torch.equal(k, k_in * c + half(k_in) * s)
