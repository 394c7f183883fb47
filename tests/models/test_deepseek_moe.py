"""DeepSeek-V3's MoE block (sigmoid router with correction bias, group-limited top-k,
routed scaling, shared experts) against transformers' DeepseekV3MoE, at EP2 and EP4."""

import pytest
import torch
from torch import nn

from atoll.launch.local import run_local
from atoll.models.checkpoint import Checkpoint, load_weights
from atoll.models.config import ModelConfig
from atoll.models.moe import make_moe, moe_targets
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext

LAYER = 1  # layer 0 is dense (first_k_dense_replace=1)
TOKENS = 9


class _Block(nn.Module):
    """Holds one layer's MoE block under the checkpoint's names for that layer."""

    def __init__(self, moe):
        super().__init__()
        self.mlp = moe

    def checkpoint_targets(self, name):
        prefix = f"model.layers.{LAYER}."
        return [(t[len(prefix):], s) for t, s in moe_targets(name) if t.startswith(prefix + "mlp.")]


def _inputs(hidden):
    return torch.randn(TOKENS, hidden, generator=torch.Generator().manual_seed(3))


def _run_block(rank, world, model_dir, layout_text):
    layout = Layout.parse(layout_text)
    ctx = ParallelContext.create(layout, rank)
    cfg = ModelConfig.load(model_dir)
    block = _Block(make_moe(cfg, ctx, torch.float32))
    load_weights(block, Checkpoint(model_dir))
    x = _inputs(cfg.hidden_size)
    if layout.dp > 1:  # DP ranks hold different tokens: DP rank 0 all of them, the others none
        return block.mlp(x if ctx.coords.dp == 0 else x[:0])
    return block.mlp(x)


@pytest.fixture(scope="module")
def deepseek(tiny_model):
    # 8 experts in 4 groups, top-2 groups, top-3 experts; a non-zero correction bias
    d = tiny_model("deepseek_v3", n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=3,
                   routed_scaling_factor=2.5)
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    mlp = ref.model.layers[LAYER].mlp
    assert type(mlp).__name__ == "DeepseekV3MoE"
    bias = torch.linspace(-0.05, 0.05, 8)
    mlp.gate.e_score_correction_bias.copy_(bias)
    # write the bias into the checkpoint too, so both sides route with it
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(d / "model.safetensors"))
    tensors[f"model.layers.{LAYER}.mlp.gate.e_score_correction_bias"] = bias
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    with torch.no_grad():
        expected = mlp(_inputs(ref.config.hidden_size)[None])[0]
    return d, expected


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["EP2", "EP4", "DP2EP2"])
def test_deepseek_moe_block_matches_transformers(deepseek, layout):
    model_dir, expected = deepseek
    world = Layout.parse(layout).world_size
    outs = run_local(_run_block, world, str(model_dir), layout, timeout_s=200)
    got = outs[0]
    if layout.startswith("DP"):
        assert all(y.shape[0] == 0 for y in outs[1:])  # the idle ranks joined and got nothing back
    else:
        for y in outs[1:]:
            assert torch.equal(y, got)  # every rank ends with the same rows
    assert got.shape == expected.shape
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
