"""Multi-head latent attention (DeepSeek-V2/V3), heads split over TP, over a latent paged cache.

Per token the cache holds one vector [c, k_r]: c the normalised kv latent (kv_lora_rank) and
k_r the rotated key part every head shares (qk_rope_head_dim), 576 values for V3, the same on
every TP rank (layers.attention.KVCache with one head and no v). For head h of this rank:

    q_h = [q_nope_h, rope(q_rope_h)]     from x: q_proj, or q_a_proj -> RMSNorm -> q_b_proj
    k_h = [W_uk_h c, k_r]                W_uk_h, W_uv_h: head h's rows of kv_b_proj
    v_h = W_uv_h c

Prefill expands each sequence's latents through kv_b_proj and attends over k_h, v_h. Decode
absorbs kv_b_proj instead: q_h . k_h = (W_uk_h^T q_nope_h) . c + rope(q_rope_h) . k_r, so the
query [W_uk_h^T q_nope_h, rope(q_rope_h)] attends over the cached vectors themselves (one head
shared by all, whose first kv_lora_rank values are also the value), and W_uv_h maps the
result to v_head_dim: a decode step reads only the latent cache. When the kernels take the
Triton path (kernels.backend.use_triton: on CUDA, or forced) the decode runs
kernels/triton_mla_decode.py, which reads the cache (plain or quantized) in place through the
block tables, q.k over D in chunks; otherwise torch gathers the blocks into one copy and runs
SDPA. (The GQA paged-attention kernel is not used: its tiles hold a whole head, sized for
<= 256 values, not 576.)

Rotary touches the rope part only. DeepSeek's rope dims come in pairs (x0, x1), (x2, x3), ...
(rope_interleave): they are gathered evens then odds, after which the rotation is the
rotate_half one; q and k are permuted alike, so their dot products are the interleaved
form's. The softmax scale is qk_head_dim**-0.5, times YaRN's mscale(factor, mscale_all_dim)
squared when the rope is scaled.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atoll.kernels.backend import use_triton
from atoll.kernels.ops import mla_decode_attention
from atoll.layers.attention import AttentionMetadata, decode_attention, gather_blocks, read_blocks, write_cache
from atoll.layers.kv_quant import QuantizedKV
from atoll.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear, divide
from atoll.layers.norm import RMSNorm
from atoll.layers.rotary import RotaryEmbedding, yarn_mscale

LATENT_EPS = 1e-6  # q_a_layernorm and kv_a_layernorm: transformers builds them with the default eps


def softmax_scale(cfg) -> float:
    """qk_head_dim**-0.5, with a scaled rope's mscale(factor, mscale_all_dim) squared folded in."""
    scale = (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim) ** -0.5
    s = cfg.rope_scaling or {}
    if (s.get("rope_type") or s.get("type") or "default") != "default" and s.get("mscale_all_dim"):
        m = yarn_mscale(s["factor"], s["mscale_all_dim"])
        scale *= m * m
    return scale


def mla_rotary(cfg) -> RotaryEmbedding:
    """The rotary of the rope part (qk_rope_head_dim wide), shared by a stage's layers."""
    return RotaryEmbedding(cfg.qk_rope_head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)


class MLAttention(nn.Module):
    def __init__(self, cfg, ctx, rotary: RotaryEmbedding, dtype):
        super().__init__()
        tp, hidden, heads = ctx.tp, cfg.hidden_size, cfg.num_attention_heads
        self.heads = divide(heads, tp.size, "num_attention_heads")  # this rank's
        self.nope, self.rope, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.latent = cfg.kv_lora_rank
        qk = self.nope + self.rope
        self.q_lora = bool(cfg.q_lora_rank)
        if self.q_lora:
            self.q_a_proj = ReplicatedLinear(hidden, cfg.q_lora_rank, bias=cfg.attention_bias, dtype=dtype)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_EPS, dtype=dtype)
            self.q_b_proj = ColumnParallelLinear(cfg.q_lora_rank, heads * qk, tp, dtype=dtype)
        else:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk, tp, dtype=dtype)
        self.kv_a_proj_with_mqa = ReplicatedLinear(hidden, self.latent + self.rope, bias=cfg.attention_bias,
                                                   dtype=dtype)
        self.kv_a_layernorm = RMSNorm(self.latent, LATENT_EPS, dtype=dtype)
        self.kv_b_proj = ColumnParallelLinear(self.latent, heads * (self.nope + self.v_dim), tp, dtype=dtype)
        self.o_proj = RowParallelLinear(heads * self.v_dim, hidden, tp, bias=cfg.attention_bias, dtype=dtype)
        self.rotary = rotary
        self.interleave = cfg.rope_interleave
        self.scale = softmax_scale(cfg)

    def forward(self, x, meta: AttentionMetadata, cache: torch.Tensor, _values=None) -> torch.Tensor:
        """x: [tokens, hidden]; cache: [blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]
        (a tensor, or a QuantizedKV: layers/kv_quant.py; the model loop passes a keys-only cache's None values too) -> [tokens, hidden]."""
        n = len(x)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))) if self.q_lora else self.q_proj(x)
        q_nope, q_rope = q.view(n, self.heads, self.nope + self.rope).split([self.nope, self.rope], dim=-1)
        c, k_rope = self.kv_a_proj_with_mqa(x).split([self.latent, self.rope], dim=-1)
        q_rope, k_rope = self._rotate(q_rope, k_rope[:, None], meta.positions)
        # [tokens, 1, kv_lora_rank + rope]: this token's cache entry
        write_cache(cache, None, torch.cat([self.kv_a_layernorm(c), k_rope[:, 0]], dim=-1)[:, None], None, meta)
        if meta.is_decode:
            out = self._decode(q_nope, q_rope, cache, meta)
        else:
            out = self._prefill(torch.cat([q_nope, q_rope], dim=-1), cache, meta)
        return self.o_proj(out.flatten(1))  # [tokens, heads/tp * v_head_dim] -> [tokens, hidden]

    def _rotate(self, q, k, positions):
        """q: [tokens, heads/tp, rope], k: [tokens, 1, rope], rotated (new tensors when interleaved)."""
        if self.interleave:
            q = torch.cat([q[..., 0::2], q[..., 1::2]], dim=-1)
            k = torch.cat([k[..., 0::2], k[..., 1::2]], dim=-1)
        return self.rotary(q, k, positions)

    def _absorbed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(W_uk [heads/tp, nope, kv_lora_rank], W_uv [heads/tp, v_head_dim, kv_lora_rank]), views of kv_b_proj."""
        w = self.kv_b_proj.weight.view(self.heads, self.nope + self.v_dim, self.latent)
        return w[:, :self.nope], w[:, self.nope:]

    def _decode(self, q_nope, q_rope, cache, meta) -> torch.Tensor:
        """One query per sequence over the latent cache -> [seqs, heads/tp, v_head_dim]. meta:
        AttentionMetadata or StaticDecode (the blocks up to the longest context, masked)."""
        if len(q_nope) == 0:  # an idle DP replica still runs the layer
            return q_nope.new_zeros(0, self.heads, self.v_dim)
        w_uk, w_uv = self._absorbed()
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [seqs, heads/tp, kv_lora_rank]
        q = torch.cat([q_latent, q_rope], dim=-1)  # [seqs, heads/tp, kv_lora_rank + rope]
        # the Triton kernel reads the latent cache in place -> [seqs, heads/tp, kv_lora_rank]; a tree
        # verify's mask (meta.visible) is read on the torch path only
        if use_triton(q, cache) and getattr(meta, "visible", None) is None:
            quantized = isinstance(cache, QuantizedKV)
            o = mla_decode_attention(q, cache.data if quantized else cache, meta.block_tables, meta.context_lens(),
                                     latent=self.latent, scale=self.scale,
                                     cache_scale=cache.kernel_scale() if quantized else None)
        else:
            def group(qs, tables, mask):
                kv = gather_blocks(cache, tables)  # [seqs, 1, keys, kv_lora_rank + rope], one copy
                # every head reads the one shared latent head; the value is its first kv_lora_rank values
                return F.scaled_dot_product_attention(qs[:, :, None], kv, kv[..., :self.latent], attn_mask=mask,
                                                      scale=self.scale, enable_gqa=self.heads > 1)[:, :, 0]

            o = decode_attention(q, meta.decode_groups(None), group)
        return torch.bmm(o.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _prefill(self, q, cache, meta) -> torch.Tensor:
        """q: [tokens, heads/tp, qk_head_dim], each sequence's keys and values expanded from its
        cached latents -> [tokens, heads/tp, v_head_dim]."""
        if len(q) == 0:  # an idle DP replica still runs the layer
            return q.new_zeros(0, self.heads, self.v_dim)
        outs, offset = [], 0
        for i, (start, n) in enumerate(zip(meta.start_list, meta.query_lens)):
            length = start + n
            blocks = -(-length // meta.block_size)
            cached = read_blocks(cache, meta.block_tables[i, :blocks]).view(-1, cache.shape[-1])[:length]
            kv = self.kv_b_proj(cached[:, :self.latent]).view(length, self.heads, self.nope + self.v_dim)
            k_rope = cached[:, None, self.latent:].expand(length, self.heads, self.rope)
            k = torch.cat([kv[..., :self.nope], k_rope], dim=-1)  # [length, heads/tp, qk_head_dim]
            v = kv[..., self.nope:]
            pos = torch.arange(start, length, device=q.device)[:, None]
            mask = torch.arange(length, device=q.device)[None, :] <= pos
            o = F.scaled_dot_product_attention(q[offset:offset + n].transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], attn_mask=mask[None, None], scale=self.scale)
            outs.append(o[0].transpose(0, 1))
            offset += n
        return torch.cat(outs)
