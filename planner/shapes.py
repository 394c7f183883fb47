"""Parameter and KV-cache arithmetic of a ModelConfig, per layer and per rank.

Counts are parameters (not bytes); the caller multiplies by the precision. Each decoder
layer is either dense (attention + MLP) or MoE (attention + routed experts + shared expert +
router); which layers are MoE is the runtime's own rule, ModelConfig.is_moe_layer (DeepSeek's
first `first_k_dense_replace`, Qwen's `mlp_only_layers` and `decoder_sparse_step`).
A tied LM head is the embedding's tensor: counted once where one rank holds both.
"""

from __future__ import annotations

from dataclasses import dataclass

from atoll.comm.experts import expert_split
from atoll.engine.kv.sizing import kv_bytes_per_token_layer
from atoll.parallel.pipeline import stage_layers


@dataclass(frozen=True)
class Shapes:
    hidden: int
    vocab: int
    layers: int
    dense_layers: tuple[bool, ...]  # per layer: True if dense MLP, False if MoE
    attn_sharded: int  # attention params split over TP (q/k/v/o; MLA's q_b, kv_b, o)
    attn_replicated: int  # attention params every TP rank holds whole (MLA's q_a, kv_a)
    dense_mlp: int  # gate+up+down of a dense layer
    expert: int  # one routed expert
    experts: int
    top_k: int
    shared_expert: int
    router: int
    embed: int
    head: int
    kv_heads: int  # 0 for MLA
    head_dim: int
    heads: int
    kv_latent: int  # MLA: kv_lora_rank + qk_rope_head_dim; 0 otherwise
    attn_dim: int  # per-head dim of the attention core (MLA absorbed: kv_lora + rope)
    tied: bool = False  # LM head shares the embedding's tensor (tie_word_embeddings)

    def _params(self, experts: int) -> int:
        """Parameters with `experts` routed experts per MoE layer."""
        attn = self.attn_sharded + self.attn_replicated
        moe = experts * self.expert + self.shared_expert + self.router
        per_layer = sum(attn + (self.dense_mlp if d else moe) for d in self.dense_layers)
        return per_layer + self.embed + (0 if self.tied else self.head)

    def experts_per_rank(self, ep: int, redundant: int = 0) -> int:
        """Routed expert slots on the busiest ep rank: the runtime's split of the experts and
        their `redundant` spare copies (comm.routing.expert_split) gives the first
        (num_experts + redundant) % ep ranks one more."""
        return max(expert_split(self.experts + redundant, ep)) if self.experts else 0

    @property
    def total_params(self) -> int:
        return self._params(self.experts)

    @property
    def active_params(self) -> int:
        """What one token reads: top_k routed experts per MoE layer."""
        return self._params(self.top_k)

    def kv_bytes_per_token_layer(self, tp: int, kv_bytes: float, scale_bytes: float = 0) -> float:
        """KV cache of one token in one layer on one TP rank. GQA heads split over TP (a rank
        keeps at least one: tp > kv_heads replicates them); MLA's latent is not split: every
        TP rank holds the whole (kv_lora_rank + rope) vector. scale_bytes: a quantized cache's
        scale per token and head (Workload.kv_scale_bytes)."""
        return kv_bytes_per_token_layer(kv_heads=self.kv_heads, head_dim=self.head_dim, tp=tp,
                                        itemsize=kv_bytes, kv_latent=self.kv_latent, scale_bytes=scale_bytes)



def shapes(config) -> Shapes:
    c = config
    h = c.hidden_size
    if c.is_mla:
        qk = c.qk_nope_head_dim + c.qk_rope_head_dim
        heads = c.num_attention_heads
        if c.q_lora_rank:
            q_rep, q_sh = h * c.q_lora_rank, c.q_lora_rank * heads * qk
        else:
            q_rep, q_sh = 0, h * heads * qk
        kv_a = h * (c.kv_lora_rank + c.qk_rope_head_dim)
        kv_b = c.kv_lora_rank * heads * (c.qk_nope_head_dim + c.v_head_dim)
        o = heads * c.v_head_dim * h
        attn_sh, attn_rep = q_sh + kv_b + o, q_rep + kv_a
        latent = c.kv_lora_rank + c.qk_rope_head_dim
        attn_dim = latent
    else:
        d = c.head_dim
        attn_sh = h * d * (2 * c.num_attention_heads + 2 * c.num_key_value_heads)
        attn_rep, latent, attn_dim = 0, 0, d
    dense = tuple(not c.is_moe_layer(i) for i in range(c.num_hidden_layers))
    return Shapes(
        hidden=h, vocab=c.vocab_size, layers=c.num_hidden_layers, dense_layers=dense,
        attn_sharded=attn_sh, attn_replicated=attn_rep,
        dense_mlp=3 * h * c.intermediate_size,
        expert=3 * h * c.moe_intermediate_size, experts=c.num_experts, top_k=c.num_experts_per_tok,
        shared_expert=3 * h * c.shared_expert_intermediate_size,
        router=h * c.num_experts,
        embed=c.vocab_size * h, head=c.vocab_size * h,
        kv_heads=0 if c.is_mla else c.num_key_value_heads, head_dim=c.head_dim,
        heads=c.num_attention_heads, kv_latent=latent, attn_dim=attn_dim, tied=c.tie_word_embeddings,
    )


_SPLITS: dict[tuple, list[tuple[int, int]]] = {}


def stage_split(config, pp: int) -> list[tuple[int, int]]:
    """parallel.pipeline.stage_layers (the split the runtime uses), memoised: its dynamic
    program is O(pp * layers^2) and the search asks for the same split many times."""
    c = config
    key = (c.num_hidden_layers, c.hidden_size, c.intermediate_size, c.moe_intermediate_size,
           c.head_dim, c.num_attention_heads, c.num_key_value_heads, c.vocab_size, pp)
    if key not in _SPLITS:
        _SPLITS[key] = stage_layers(config, pp)
    return _SPLITS[key]
