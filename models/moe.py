"""MoE families on the Llama skeleton: Mixtral, Qwen2-MoE (shared expert with a gate) and
Qwen3-MoE (q/k norm). Attention is the Llama family's; the MLP of each MoE layer is a
SparseMoE, dense layers (Qwen2-MoE's mlp_only_layers) keep a GatedMLP."""

from __future__ import annotations

import re
from contextlib import ExitStack, contextmanager
from functools import cached_property

import torch

from atoll.config.engine import EngineConfig
from atoll.layers.linear import ReplicatedLinear
from atoll.layers.mlp import GatedMLP
from atoll.layers.moe import SparseMoE
from atoll.layers.router import Router
from atoll.models.config import ModelConfig
from atoll.models.llama import LlamaForCausalLM, dense_source, dense_targets

# per-expert checkpoint tensors -> (fused parameter, shard id part)
_EXPERT = re.compile(r"(.*\.experts)\.(\d+)\.(w1|w2|w3|gate_proj|up_proj|down_proj)\.weight$")
_PART = {"w1": ("w13", 0), "gate_proj": ("w13", 0), "w3": ("w13", 1), "up_proj": ("w13", 1),
         "w2": ("w2", "down"), "down_proj": ("w2", "down")}


def moe_targets(name: str, *, tied: bool = False) -> list[tuple[str, object]]:
    """As dense_targets, plus each expert's tensors into the fused w13 / w2 of its layer."""
    name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's name for the MoE block
    m = _EXPERT.match(name)
    if m:
        param, part = _PART[m.group(3)]
        return [(f"{m.group(1)}.{param}", (int(m.group(2)), part))]
    return dense_targets(name, tied=tied)


def moe_source(param: str, shard, *, mixtral: bool = False) -> str:
    """The checkpoint tensor that fills `shard` of `param` (moe_targets backwards)."""
    if param.endswith((".experts.w13", ".experts.w2")):
        expert, part = shard
        kind = {0: ("gate_proj", "w1"), 1: ("up_proj", "w3"), "down": ("down_proj", "w2")}[part][mixtral]
        name = f"{param.rsplit('.', 1)[0]}.{expert}.{kind}.weight"
    else:
        name = dense_source(param, shard)
    return name.replace(".mlp.", ".block_sparse_moe.") if mixtral else name


def make_router(cfg: ModelConfig, dtype) -> Router:
    return Router(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, scoring=cfg.scoring,
                  renormalize=cfg.norm_topk_prob or cfg.model_type == "mixtral", n_group=cfg.n_group,
                  topk_group=cfg.topk_group, scaling=cfg.routed_scaling_factor, dtype=dtype)


def make_moe(cfg: ModelConfig, ctx, dtype, engine: EngineConfig | None = None) -> SparseMoE:
    shared = shared_gate = None
    if cfg.shared_expert_intermediate_size:
        shared = GatedMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, ctx.tp, dtype=dtype)
        if cfg.model_type == "qwen2_moe":
            shared_gate = ReplicatedLinear(cfg.hidden_size, 1, dtype=dtype)
    return SparseMoE(hidden=cfg.hidden_size, inter=cfg.moe_intermediate_size, router=make_router(cfg, dtype),
                     ctx=ctx, dtype=dtype, shared=shared, shared_gate=shared_gate, engine=engine)


class MoeForCausalLM(LlamaForCausalLM):
    def __init__(self, cfg: ModelConfig, ctx, *, dtype=torch.float32, engine: EngineConfig | None = None):
        """engine: the run's switches its MoE layers take (dispatch, exchange; None: the defaults)."""

        def make_mlp(i):
            if cfg.is_moe_layer(i):
                return make_moe(cfg, ctx, dtype, engine)
            return GatedMLP(cfg.hidden_size, cfg.intermediate_size, ctx.tp, dtype=dtype)

        super().__init__(cfg, ctx, dtype=dtype, make_mlp=make_mlp)
        self.share_load()

    def share_load(self) -> None:
        """One [moe layers, slots] int64 tensor, `expert_load`, whose rows are the stage's MoE
        layers' load counters (layers/expert_map.py): the window takes a step's counts in one
        copy (engine/rank/eplb.py)."""
        layers = self.moe_layers
        slots = layers[0].placement.num_slots if layers else 0
        device = next(self.parameters()).device
        self.expert_load = torch.zeros(len(layers), slots, dtype=torch.long, device=device)
        for i, m in enumerate(layers):
            m.expert_load.counts = self.expert_load[i]

    @cached_property
    def moe_layer_ids(self) -> list[int]:
        """The global index of each of moe_layers, in order."""
        return [int(i) for i, layer in self.model.layers.items() if isinstance(layer.mlp, SparseMoE)]

    @cached_property
    def moe_layers(self) -> list[SparseMoE]:
        """The stage's MoE layers, listed once (a step enters each: static_exchange)."""
        return [layer.mlp for layer in self.model.layers.values() if isinstance(layer.mlp, SparseMoE)]

    @contextmanager
    def static_exchange(self, real: torch.Tensor | None = None):
        """Steps run inside take each MoE layer's fixed-shape exchange (SparseMoE.static_exchange);
        real: [rows] bool, the step's rows that are not padding (the load counters skip padding)."""
        with ExitStack() as stack:
            for m in self.moe_layers:
                stack.enter_context(m.static_exchange(real))
            yield self

    def checkpoint_targets(self, name: str):
        return moe_targets(name, tied=self.config.tie_word_embeddings)

    def checkpoint_name(self, param: str, shard) -> str:
        return moe_source(param, shard, mixtral=self.config.model_type == "mixtral")
