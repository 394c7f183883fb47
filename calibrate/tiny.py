"""Tiny random checkpoints in Hugging Face's layout (config.json + model.safetensors), written
with safetensors alone: the runtime loads them like any checkpoint, so a decode step of one
times the runtime's own per-layer and per-step work while its FLOPs and bytes are near zero."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-6,
            rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="float32")
MOE = dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64, norm_topk_prob=True,
           decoder_sparse_step=1, mlp_only_layers=[])


def write_tiny(out: Path, *, layers: int, moe: bool = False, seed: int = 0, **overrides) -> Path:
    """A llama (or qwen3_moe with `moe`) checkpoint of `layers` layers in `out`."""
    cfg = {**TINY, "num_hidden_layers": layers, **(MOE if moe else {}), **overrides}
    cfg["model_type"] = "qwen3_moe" if moe else "llama"
    h, d, inter = cfg["hidden_size"], cfg["head_dim"], cfg["intermediate_size"]
    heads, kv, vocab = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["vocab_size"]
    g = torch.Generator().manual_seed(seed)

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    t = {"model.embed_tokens.weight": rand(vocab, h), "model.norm.weight": torch.ones(h),
         "lm_head.weight": rand(vocab, h)}
    for i in range(layers):
        p = f"model.layers.{i}."
        t |= {p + "input_layernorm.weight": torch.ones(h), p + "post_attention_layernorm.weight": torch.ones(h),
              p + "self_attn.q_proj.weight": rand(heads * d, h), p + "self_attn.k_proj.weight": rand(kv * d, h),
              p + "self_attn.v_proj.weight": rand(kv * d, h), p + "self_attn.o_proj.weight": rand(h, heads * d)}
        if moe:
            t |= {p + "self_attn.q_norm.weight": torch.ones(d), p + "self_attn.k_norm.weight": torch.ones(d),
                  p + "mlp.gate.weight": rand(cfg["num_experts"], h)}
            m = cfg["moe_intermediate_size"]
            for e in range(cfg["num_experts"]):
                q = f"{p}mlp.experts.{e}."
                t |= {q + "gate_proj.weight": rand(m, h), q + "up_proj.weight": rand(m, h),
                      q + "down_proj.weight": rand(h, m)}
        else:
            t |= {p + "mlp.gate_proj.weight": rand(inter, h), p + "mlp.up_proj.weight": rand(inter, h),
                  p + "mlp.down_proj.weight": rand(h, inter)}
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in t.items()}, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    return out
