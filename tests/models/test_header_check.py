"""Weight shapes and dtypes are checked from the safetensors headers in the parent, before
any rank starts: every layout's slices, as the ranks would read them."""

import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from atoll.launch.api import LLM
from atoll.errors import CheckpointError


def _rewrite(src, dst, change):
    shutil.copytree(src, dst)
    f = next(dst.glob("*.safetensors"))
    tensors = load_file(f)
    change(tensors)
    save_file(tensors, f, metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("kind,layout", [("llama", "TP2PP2"), ("qwen3_moe", "DP2EP2"), ("mixtral", "EP2")])
def test_good_checkpoints_pass(tiny_model, kind, layout):
    LLM(tiny_model(kind), layout=layout, device="cpu")


def test_a_wrong_shape_fails_in_the_parent(tiny_model, tmp_path):
    name = "model.layers.2.self_attn.k_proj.weight"  # the last stage's layer under PP2
    d = _rewrite(tiny_model("llama"), tmp_path / "m",
                 lambda t: t.__setitem__(name, t[name][:-2].clone()))
    with pytest.raises(CheckpointError, match=f"tensor {name} does not fit the model config"):
        LLM(d, layout="TP2PP2", device="cpu")


def test_a_wrong_expert_shape_fails_in_the_parent(tiny_model, tmp_path):
    def change(t):
        key = next(k for k in t if ".experts." in k and k.endswith("down_proj.weight"))
        t[key] = t[key][:, :-1].clone()

    d = _rewrite(tiny_model("qwen3_moe"), tmp_path / "m", change)
    with pytest.raises(CheckpointError, match="does not fit the model config"):
        LLM(d, layout="EP2", device="cpu")


def test_an_unloadable_dtype_is_named(tiny_model, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    d = _rewrite(tiny_model("llama"), tmp_path / "m",
                 lambda t: t.__setitem__(name, t[name].to(torch.int8)))
    with pytest.raises(CheckpointError, match=f"tensor {name} is stored as I8"):
        LLM(d, layout="TP2", device="cpu")
