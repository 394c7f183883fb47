"""DeepSeek-V2 and DeepSeek-V3 as transformers defines them: MLA attention (layers.mla) over a
latent paged cache; the first `first_k_dense_replace` layers with a dense MLP, the others MoE
with shared experts and each version's router (V3: sigmoid, corrected, group-limited; V2:
softmax). Holds this rank's pipeline stage; module names mirror transformers', so checkpoint
names map one to one.

The official V3 checkpoint carries a multi-token-prediction module after the last decoder
layer (model.layers.61.*, `num_nextn_predict_layers`) for speculative decoding. The target
model reads none of it: every tensor of a layer at index >= num_hidden_layers maps to nothing
here (and models/unused.py lists them as known unused, so strict loading skips them unread);
the deepseek_mtp drafter (engine/spec/mtp.py) loads it into a module of its own (models/mtp.py).
"""

from __future__ import annotations

import torch
from torch import nn

from atoll.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from atoll.layers.mla import MLAttention, mla_rotary
from atoll.layers.mlp import GatedMLP
from atoll.layers.norm import RMSNorm
from atoll.models.config import ModelConfig
from atoll.models.llama import LlamaDecoderLayer
from atoll.models.moe import MoeForCausalLM, make_moe, moe_targets
from atoll.models.unused import after_last_layer
from atoll.parallel.pipeline import stage_layers


class DeepseekDecoderLayer(LlamaDecoderLayer):
    """Llama's pre-norm residual block (its forward, the adds fused into the norms) around MLA."""

    def __init__(self, cfg: ModelConfig, ctx, rotary, dtype, mlp: nn.Module):
        nn.Module.__init__(self)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = MLAttention(cfg, ctx, rotary, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = mlp


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx, start: int, end: int, dtype, make_mlp):
        super().__init__()
        self.start, self.end = start, end
        rotary = mla_rotary(cfg)
        if ctx.is_first_stage:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.tp, dtype=dtype)
        # keyed by global layer index, so parameter names match the checkpoint's
        self.layers = nn.ModuleDict({str(i): DeepseekDecoderLayer(cfg, ctx, rotary, dtype, make_mlp(i))
                                     for i in range(start, end)})
        if ctx.is_last_stage:
            self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)


class DeepseekForCausalLM(MoeForCausalLM):
    """DeepseekV3ForCausalLM / DeepseekV2ForCausalLM; forward and checkpoint naming are the MoE
    families' (each layer gets its latent cache, and None for the values a keys-only cache lacks)."""

    def __init__(self, cfg: ModelConfig, ctx, *, dtype=torch.float32, engine=None):
        nn.Module.__init__(self)
        self.config, self.ctx = cfg, ctx

        def make_mlp(i):
            if cfg.is_moe_layer(i):
                return make_moe(cfg, ctx, dtype, engine)
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size, ctx.tp, dtype=dtype)

        start, end = stage_layers(cfg, ctx.layout.pp)[ctx.coords.pp]
        self.model = DeepseekModel(cfg, ctx, start, end, dtype, make_mlp)
        if ctx.is_last_stage:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx.tp, dtype=dtype)
        self.share_load()

    def checkpoint_targets(self, name: str) -> list[tuple[str, object]]:
        if after_last_layer(name, self.config):  # the multi-token-prediction layer
            return []
        if ".self_attn." in name:  # MLA's projections are loaded as they are (no q/k/v stacking)
            return [(name, None)]
        return moe_targets(name, tied=self.config.tie_word_embeddings)
