"""DeepSeek-V3's multi-token-prediction (MTP) module, as its checkpoint stores it after the
last decoder layer: model.layers.N.*, N = num_hidden_layers, when num_nextn_predict_layers > 0.

    enorm, hnorm                 RMSNorms of the next token's embedding and of the target's hidden state
    eh_proj                      Linear 2*hidden -> hidden over their concatenation
    input_layernorm, self_attn,  a decoder block like the target's layers: MLA, then MoE
    post_attention_layernorm,    (or a dense MLP where layer N would have one)
    mlp
    shared_head.norm, .head      the final norm and LM head of its prediction
    embed_tokens                 the official checkpoint's copy of the target's embedding: not
                                 read, the target's own embed_tokens is shared

Per the DeepSeek-V3 report (section 2.2), position i's input combines h_i, the target's last
hidden state before its final norm, with Emb(t_{i+1}); the block, shared_head.norm and
shared_head.head then predict t_{i+2}. The concatenation is [enorm(Emb(t_{i+1})), hnorm(h_i)],
the embedding first: the order of the released weights (vLLM and SGLang read them so; the
report writes M[RMSNorm(h); RMSNorm(Emb)] the other way round). Sharded as the target's layers
are: MLA heads over tp, routed experts over ep (and moe_tp), the head's vocabulary over tp;
eh_proj and the norms are replicated.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from torch import nn

from atoll.layers.embedding import ParallelLMHead
from atoll.layers.linear import ReplicatedLinear
from atoll.layers.mla import mla_rotary
from atoll.layers.mlp import GatedMLP
from atoll.layers.norm import RMSNorm
from atoll.models.config import ModelConfig
from atoll.models.deepseek import DeepseekDecoderLayer
from atoll.models.moe import make_moe, moe_source, moe_targets

# the tensors every MTP layer has outside its decoder block, named in a missing-tensor error
OWN = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight", "shared_head.head.weight")


def mtp_layers(config: ModelConfig) -> int:
    """The MTP layers config.json declares (num_nextn_predict_layers; 0 when absent)."""
    return int(config.raw.get("num_nextn_predict_layers") or 0)


class SharedHead(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx, dtype):
        super().__init__()
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.head = ParallelLMHead(cfg.vocab_size, cfg.hidden_size, ctx.tp, dtype=dtype)


class DeepseekMTP(DeepseekDecoderLayer):
    """The first MTP layer (model.layers.{num_hidden_layers}), the decoder block's modules at
    the top level so parameter names are the checkpoint's after the layer prefix."""

    def __init__(self, cfg: ModelConfig, ctx, *, dtype=torch.float32, engine=None):
        index = cfg.num_hidden_layers
        if cfg.is_moe_layer(index):
            mlp = make_moe(cfg, ctx, dtype, engine)
        else:
            mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, ctx.tp, dtype=dtype)
        super().__init__(cfg, ctx, mla_rotary(cfg), dtype, mlp)
        self.index = index
        # the loader skips layers past the config's last as unused (models/unused.py): this
        # module's config counts layer `index` as one, and keeps the checkpoint's fp8 scheme
        self.config = replace(cfg, num_hidden_layers=index + 1)
        self.enorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.hnorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.eh_proj = ReplicatedLinear(2 * cfg.hidden_size, cfg.hidden_size, dtype=dtype)
        self.shared_head = SharedHead(cfg, ctx, dtype)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, meta, cache) -> torch.Tensor:
        """emb: [tokens, hidden] Emb(t_{i+1}); hidden: [tokens, hidden] h_i, at positions
        meta.positions (i); cache: the MTP's own one-layer latent cache -> [tokens, hidden],
        the block's output before shared_head.norm (the next h when applied recurrently)."""
        x = self.eh_proj(torch.cat([self.enorm(emb), self.hnorm(hidden)], dim=-1))
        h, residual = super().forward(x, None, meta, cache.k[0], cache.v[0])
        return residual + h

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """h: [rows, hidden] (forward's output) -> [rows, vocab], t_{i+2}'s logits."""
        return self.shared_head.head(self.shared_head.norm(h))

    @property
    def prefix(self) -> str:
        return f"model.layers.{self.index}."

    def checkpoint_targets(self, name: str) -> list[tuple[str, object]]:
        if not name.startswith(self.prefix):
            return []
        name = name[len(self.prefix):]
        if name.startswith("self_attn."):  # MLA's projections are loaded as they are
            return [(name, None)]
        return moe_targets(name)  # embed_tokens names no parameter here: left unread

    def checkpoint_name(self, param: str, shard) -> str:
        return self.prefix + (param if param.startswith("self_attn.") else moe_source(param, shard))
