"""Strict loading: a checkpoint tensor nothing reads, a parameter nothing fills, or a dtype
atoll cannot read is one CheckpointError line naming the tensor, in the parent before any
rank starts (LLM's header check) and on the ranks at the end of loading (the launcher's
one-line RankFailure). Tensors a family never reads by design are listed in models/unused.py."""

import json
import re
import shutil

import pytest
import torch
from fp8_quant import write_fp8_pair
from safetensors.torch import load_file, save_file

from atoll.launch.api import LLM
from atoll.engine.rank.run_spec import RunSpec
from atoll.engine.rank.runner import ModelRunner
from atoll.errors import CheckpointError, RankFailure
from atoll.launch.local import run_local
from atoll.models.config import ModelConfig
from atoll.models.unused import known_unused
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext


def _rewrite(src, dst, change=None, config=None):
    """A copy of checkpoint src with change(tensors) and config(dict) applied."""
    shutil.copytree(src, dst)
    if change is not None:
        f = next(dst.glob("*.safetensors"))
        tensors = load_file(f)
        change(tensors)
        save_file(tensors, f, metadata={"format": "pt"})
    if config is not None:
        d = json.loads((dst / "config.json").read_text())
        config(d)
        (dst / "config.json").write_text(json.dumps(d))
    return dst


def _load(rank, world, model_dir, layout):
    ModelRunner(RunSpec.of(model_dir, layout, max_model_len=64), ParallelContext.create(Layout.parse(layout), rank))


def _one_line(err) -> str:
    text = str(err.value)
    assert "\n" not in text
    return text


# --- a tensor nothing reads ---

def test_an_extra_tensor_is_named(tiny_model, tmp_path):
    name = "model.layers.1.mlp.extra_proj.weight"
    d = _rewrite(tiny_model("llama"), tmp_path / "m", lambda t: t.__setitem__(name, torch.zeros(4, 4)))
    with pytest.raises(CheckpointError, match=f"^checkpoint tensor {re.escape(name)} is read by no parameter "
                                              "of the llama model$"):
        LLM(d, layout="TP2PP2", device="cpu")


@pytest.mark.timeout(240)
def test_an_expert_no_rank_holds_is_named_on_the_ranks(tiny_model, tmp_path):
    # expert 4 of a 4-expert model: every rank offers it to its experts, none holds it
    name = "model.layers.0.mlp.experts.4.up_proj.weight"
    d = _rewrite(tiny_model("qwen3_moe"), tmp_path / "m",
                 lambda t: t.__setitem__(name, t["model.layers.0.mlp.experts.3.up_proj.weight"].clone()))
    with pytest.raises(RankFailure) as e:
        run_local(_load, 2, str(d), "EP2", timeout_s=200)
    assert f"checkpoint tensor {name} is read by no parameter of the qwen3_moe model" in _one_line(e)


def test_known_unused_tensors_are_skipped(tiny_model, tmp_path):
    def add_rotary(t):
        for i in range(3):
            t[f"model.layers.{i}.self_attn.rotary_emb.inv_freq"] = torch.ones(8)

    LLM(_rewrite(tiny_model("llama"), tmp_path / "m", add_rotary), layout="TP2", device="cpu")
    v3 = ModelConfig.load(tiny_model("deepseek_v3"))
    mtp = v3.num_hidden_layers  # the multi-token-prediction layer follows the last decoder layer
    assert known_unused(f"model.layers.{mtp}.eh_proj.weight", v3)
    assert known_unused(f"model.layers.{mtp}.mlp.experts.0.up_proj.weight_scale_inv", v3)
    assert not known_unused(f"model.layers.{mtp - 1}.mlp.gate.weight", v3)
    llama = ModelConfig.load(tiny_model("llama"))
    assert not known_unused(f"model.layers.{llama.num_hidden_layers}.mlp.up_proj.weight", llama)


# --- a parameter nothing fills ---

@pytest.mark.parametrize("kind,layout,name", [
    ("llama", "TP2PP2", "model.layers.2.self_attn.k_proj.weight"),
    ("qwen3_moe", "EP2", "model.layers.1.mlp.experts.3.down_proj.weight"),
    ("mixtral", "EP2", "model.layers.1.block_sparse_moe.experts.2.w3.weight"),
])
def test_a_missing_tensor_is_named(tiny_model, tmp_path, kind, layout, name):
    d = _rewrite(tiny_model(kind), tmp_path / "m", lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=f"^checkpoint .* lacks tensor {re.escape(name)}$"):
        LLM(d, layout=layout, device="cpu")


# --- a dtype atoll cannot read ---

@pytest.mark.timeout(240)
def test_an_int8_tensor_is_named_on_the_ranks(tiny_model, tmp_path):
    name = "model.layers.0.mlp.up_proj.weight"
    d = _rewrite(tiny_model("llama"), tmp_path / "m", lambda t: t.__setitem__(name, t[name].to(torch.int8)))
    with pytest.raises(CheckpointError, match=f"^tensor {re.escape(name)} is stored as I8"):
        LLM(d, layout="TP2", device="cpu")
    with pytest.raises(RankFailure) as e:
        run_local(_load, 2, str(d), "TP2", timeout_s=200)
    assert f"tensor {name} is stored as I8, which atoll cannot load" in _one_line(e)


@pytest.fixture(scope="module")
def fp8_llama(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-strict")
    return write_fp8_pair(tiny_model("llama"), root / "fp8", root / "ref")[0]


def test_fp8_without_a_quantization_config_is_named(fp8_llama, tmp_path):
    d = _rewrite(fp8_llama, tmp_path / "m", config=lambda c: c.pop("quantization_config"))
    with pytest.raises(CheckpointError, match=r"^tensor model\.layers\.\d+\.\S+_proj\.weight is stored as "
                                              "F8_E4M3 but config.json has no fp8 quantization_config"):
        LLM(d, layout="TP2", device="cpu")


def test_fp8_without_its_scales_is_named(fp8_llama, tmp_path):
    name = "model.layers.1.self_attn.o_proj.weight"
    d = _rewrite(fp8_llama, tmp_path / "m", lambda t: t.pop(name + "_scale_inv"))
    with pytest.raises(CheckpointError, match=f"^tensor {re.escape(name)} is stored as F8_E4M3 without "
                                              f"its block scales {re.escape(name)}_scale_inv$"):
        LLM(d, layout="TP2", device="cpu")


def test_another_quantization_is_refused(tiny_model, tmp_path):
    d = _rewrite(tiny_model("llama"), tmp_path / "m",
                 config=lambda c: c.__setitem__("quantization_config", {"quant_method": "awq", "bits": 4}))
    with pytest.raises(CheckpointError, match="quant_method='awq' is not supported"):
        LLM(d, layout="TP1", device="cpu")


def test_a_tied_model_that_stores_its_own_head_reads_it_as_transformers_does(tiny_model, tmp_path):
    """tie_word_embeddings with an lm_head.weight of its own in the checkpoint: transformers
    keeps that tensor as the head (it ties only equal ones), and so does atoll."""
    from reference import reference_tokens

    from atoll import SamplingParams

    def own_head(t):
        t["lm_head.weight"] = torch.randn_like(t["model.embed_tokens.weight"]) * 0.5

    d = _rewrite(tiny_model("llama"), tmp_path / "tied", own_head, lambda c: c.update(tie_word_embeddings=True))
    assert not ModelConfig.load(d).tie_word_embeddings
    prompts = [[5, 7, 9, 11], [42, 1, 2]]
    mine = [o.token_ids for o in LLM(d, layout="TP2", device="cpu").generate(
        [{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=6, ignore_eos=True))]
    assert mine == reference_tokens(d, prompts, 6)
    plain = _rewrite(tiny_model("llama"), tmp_path / "plain", lambda t: t.pop("lm_head.weight", None),
                     lambda c: c.update(tie_word_embeddings=True))
    assert ModelConfig.load(plain).tie_word_embeddings
