"""The tiny random models that the parity tests are built on: each kind builds and reloads."""

import json

import pytest
import torch
from safetensors import safe_open

from conftest import TINY_KINDS


@pytest.mark.parametrize("kind", list(TINY_KINDS))
def test_tiny_model_builds_and_reloads(tiny_model, kind):
    from transformers import AutoModelForCausalLM

    d = tiny_model(kind)
    assert tiny_model(kind) == d  # cached per arguments
    cfg = json.loads((d / "config.json").read_text())
    assert cfg["model_type"] == kind and cfg["vocab_size"] % 4
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        assert {f.get_tensor(k).dtype for k in f.keys()} == {torch.float32}
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    logits = model(torch.tensor([[5, 7, 9]])).logits
    assert logits.shape == (1, 3, cfg["vocab_size"]) and torch.isfinite(logits).all()


def test_tiny_model_is_seeded_and_overrides_apply(tiny_model, tmp_path):
    from conftest import build_tiny_model

    a = build_tiny_model("llama", tmp_path / "a")
    b = build_tiny_model("llama", tmp_path / "b")
    with safe_open(str(a / "model.safetensors"), "pt") as fa, \
            safe_open(str(b / "model.safetensors"), "pt") as fb:
        assert all(torch.equal(fa.get_tensor(k), fb.get_tensor(k)) for k in fa.keys())
    tied = tiny_model("llama", tie_word_embeddings=True, num_hidden_layers=2)
    assert tied != tiny_model("llama")
    cfg = json.loads((tied / "config.json").read_text())
    assert cfg["tie_word_embeddings"] and cfg["num_hidden_layers"] == 2
    with safe_open(str(tied / "model.safetensors"), "pt") as f:
        assert "lm_head.weight" not in f.keys()
