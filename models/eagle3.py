"""An EAGLE-3 head (Li et al. 2025) in the layout published for vLLM and SGLang
(LlamaForCausalLMEagle3, e.g. yuhuili/EAGLE3-LLaMA3.1-Instruct-8B), one directory with
config.json and model.safetensors:

    fc.weight                          [H, 3*H_t]  the three target layers' hidden states fused
    midlayer.input_layernorm.weight    [H]         norm of the next token's embedding
    midlayer.hidden_norm.weight        [H]         norm of the fused hidden state
    midlayer.self_attn.{q,k,v}_proj    [*, 2*H]    attention over concat(embeds, hidden)
    midlayer.self_attn.o_proj          [H, heads*head_dim]
    midlayer.post_attention_layernorm  [H]
    midlayer.mlp.{gate,up,down}_proj   a gated MLP
    norm.weight                        [H]         the final norm
    lm_head.weight                     [draft_vocab_size, H]
    d2t                                [draft_vocab_size] int64: target id = draft id + d2t[draft id]
    t2d                                [vocab_size] bool: which target ids the draft vocabulary holds (not read)
    embed_tokens.weight                optional: else the target's embedding is shared

config.json: hidden_size, num_attention_heads, num_key_value_heads, intermediate_size,
rms_norm_eps, rope_theta, vocab_size, draft_vocab_size, optional target_hidden_size and
eagle_config.eagle_aux_hidden_state_layer_ids (default: layers 2, L/2 and L-3 of an L-layer
target; a layer's hidden state is its input, the residual stream before it, as vLLM takes it).

The layer at position i reads g_i = fc(concat of the three states) and Emb(t_{i+1}):
x = concat(input_layernorm(Emb), hidden_norm(g)); the residual stream starts at g; attention,
post_attention_layernorm, MLP as Llama's; the output before `norm` is the next step's hidden
state when drafting recurrently, and lm_head(norm(.)) gives t_{i+2} in the draft vocabulary.
Sharded as the target's layers are: heads and MLP over tp, lm_head's vocabulary over tp; fc
and the norms replicated.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from torch import nn

from atoll.errors import InputError
from atoll.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from atoll.layers.linear import QKVParallelLinear, ReplicatedLinear
from atoll.layers.mlp import GatedMLP
from atoll.layers.norm import RMSNorm
from atoll.layers.rotary import RotaryEmbedding
from atoll.models.config import ModelConfig
from atoll.models.llama import LlamaAttention, dense_source, dense_targets
from atoll.models.safetensors_header import read_header

MAPS = ("d2t", "t2d")


def aux_layers(head: dict, target_layers: int) -> list[int]:
    """The target layers whose input hidden states the head fuses (vLLM's default 2, L/2, L-3)."""
    ids = (head.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
    if ids is None:
        return [2, target_layers // 2, target_layers - 3]
    if len(ids) != 3 or any(not isinstance(i, int) or not 0 <= i < target_layers for i in ids):
        raise InputError(f"EAGLE-3 head: eagle_aux_hidden_state_layer_ids={ids} must be three layer indices "
                         f"below the target's {target_layers}")
    return list(ids)


def expected_shapes(cfg: ModelConfig, raw: dict) -> dict[str, tuple]:
    """Each tensor's full shape as the published layout stores it."""
    h, d, hd = cfg.hidden_size, raw.get("target_hidden_size") or cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    m, dv = "midlayer.", raw.get("draft_vocab_size") or cfg.vocab_size
    return {"fc.weight": (h, 3 * d), m + "input_layernorm.weight": (h,), m + "hidden_norm.weight": (h,),
            m + "self_attn.q_proj.weight": (q, 2 * h), m + "self_attn.k_proj.weight": (kv, 2 * h),
            m + "self_attn.v_proj.weight": (kv, 2 * h), m + "self_attn.o_proj.weight": (h, q),
            m + "post_attention_layernorm.weight": (h,), m + "mlp.gate_proj.weight": (cfg.intermediate_size, h),
            m + "mlp.up_proj.weight": (cfg.intermediate_size, h), m + "mlp.down_proj.weight": (h, cfg.intermediate_size),
            "norm.weight": (h,), "lm_head.weight": (dv, h), "d2t": (dv,)}


def check_head(model_dir, target: ModelConfig) -> tuple[ModelConfig, dict]:
    """The head's config and its tensors' headers, or one line naming the first tensor missing or
    of the wrong shape (or the config field that does not fit the target)."""
    path = Path(model_dir)
    cfg = ModelConfig.load(path)
    raw = cfg.raw
    if (raw.get("target_hidden_size") or cfg.hidden_size) != target.hidden_size:
        raise InputError(f"EAGLE-3 head {path}: its target_hidden_size/hidden_size "
                         f"{raw.get('target_hidden_size') or cfg.hidden_size} is not the target's {target.hidden_size}")
    if cfg.vocab_size != target.vocab_size:
        raise InputError(f"EAGLE-3 head {path}: vocab_size {cfg.vocab_size} is not the target's {target.vocab_size}")
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise InputError(f"EAGLE-3 head {path} has no .safetensors file (a .bin head: convert it first)")
    header = {n: info for f in files for n, info in read_header(f).items() if n != "__metadata__"}
    for name, shape in expected_shapes(cfg, raw).items():
        if name not in header:
            raise InputError(f"EAGLE-3 head {path} lacks tensor {name}")
        if tuple(header[name]["shape"]) != shape:
            raise InputError(f"EAGLE-3 head {path}: tensor {name} has shape {tuple(header[name]['shape'])}, "
                             f"the config asks {shape}")
    if header["d2t"]["dtype"] not in ("I64", "I32"):
        raise InputError(f"EAGLE-3 head {path}: tensor d2t is {header['d2t']['dtype']}, not an integer map")
    aux_layers(raw, target.num_hidden_layers)
    return cfg, header


class Eagle3Attention(LlamaAttention):
    """Llama's attention whose q/k/v read concat(embeds, hidden): 2*H wide."""

    def __init__(self, cfg: ModelConfig, ctx, rotary, dtype):
        super().__init__(cfg, ctx, rotary, dtype)
        self.qkv_proj = QKVParallelLinear(2 * cfg.hidden_size, cfg.head_dim, cfg.num_attention_heads,
                                          cfg.num_key_value_heads, ctx.tp, bias=False, dtype=dtype)


class MidLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, ctx, dtype):
        super().__init__()
        eps = cfg.rms_norm_eps
        rotary = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling, cfg.max_position_embeddings)
        self.input_layernorm = RMSNorm(cfg.hidden_size, eps, dtype=dtype)
        self.hidden_norm = RMSNorm(cfg.hidden_size, eps, dtype=dtype)
        self.self_attn = Eagle3Attention(cfg, ctx, rotary, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, eps, dtype=dtype)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, ctx.tp, dtype=dtype)


class Eagle3Head(nn.Module):
    """The head's modules under the published names (midlayer, fc, norm, lm_head)."""

    def __init__(self, cfg: ModelConfig, ctx, *, own_embedding: bool = False, dtype=torch.float32):
        super().__init__()
        raw = cfg.raw
        self.config = cfg
        self.draft_vocab = raw.get("draft_vocab_size") or cfg.vocab_size
        target_hidden = raw.get("target_hidden_size") or cfg.hidden_size
        self.fc = ReplicatedLinear(3 * target_hidden, cfg.hidden_size, dtype=dtype)
        self.midlayer = MidLayer(cfg, ctx, dtype)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = ParallelLMHead(self.draft_vocab, cfg.hidden_size, ctx.tp, dtype=dtype)
        if own_embedding:
            self.embed_tokens = VocabParallelEmbedding(cfg.vocab_size, cfg.hidden_size, ctx.tp, dtype=dtype)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab, dtype=torch.long), persistent=False)

    def forward(self, emb: torch.Tensor, hidden: torch.Tensor, meta, cache) -> torch.Tensor:
        """emb: [tokens, H] Emb(t_{i+1}); hidden: [tokens, H] g_i (fc's output, or the head's own
        previous output) at positions meta.positions -> [tokens, H], the output before `norm`."""
        layer = self.midlayer
        residual = hidden.clone()  # the norm below adds into it in place
        x = torch.cat([layer.input_layernorm(emb), layer.hidden_norm(hidden)], dim=-1)
        h = layer.post_attention_layernorm(layer.self_attn(x, meta, cache.k[0], cache.v[0]), residual=residual)
        return residual + layer.mlp(h)

    def tokens(self, h: torch.Tensor) -> torch.Tensor:
        """h: [rows, H] (forward's output) -> [rows] the greedy next token, as a target id."""
        draft = self.lm_head(self.norm(h)).argmax(-1)
        return draft + self.d2t[draft]

    def checkpoint_targets(self, name: str) -> list[tuple[str, object]]:
        if name in MAPS:
            return []  # d2t is read by load_maps; t2d is d2t's inverse, not needed
        return dense_targets(name)

    def checkpoint_name(self, param: str, shard) -> str:
        return dense_source(param, shard)

    def load_maps(self, checkpoint) -> None:
        """d2t from the head's checkpoint, checked to map into the target's vocabulary."""
        d2t = checkpoint.get("d2t")[:].to(torch.long)
        ids = torch.arange(len(d2t)) + d2t
        if int(ids.min()) < 0 or int(ids.max()) >= self.config.vocab_size:
            raise InputError(f"EAGLE-3 head: tensor d2t maps a draft id outside the target's {self.config.vocab_size} "
                             "tokens")
        self.d2t.copy_(d2t)


def head_config(target: ModelConfig, *, draft_vocab_size: int, intermediate_size: int | None = None,
                aux: list[int] | None = None) -> dict:
    """config.json of a head for `target` in the published layout (LlamaForCausalLMEagle3)."""
    raw = target.raw
    out = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "num_hidden_layers": 1,
           "hidden_size": target.hidden_size, "num_attention_heads": target.num_attention_heads,
           "num_key_value_heads": target.num_key_value_heads, "head_dim": target.head_dim,
           "intermediate_size": intermediate_size or target.intermediate_size, "hidden_act": "silu",
           "rms_norm_eps": target.rms_norm_eps, "rope_theta": target.rope_theta,
           "rope_scaling": raw.get("rope_scaling"), "max_position_embeddings": target.max_position_embeddings,
           "vocab_size": target.vocab_size, "draft_vocab_size": draft_vocab_size, "tie_word_embeddings": False,
           "torch_dtype": "float32"}
    if aux is not None:
        out["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux)}
    return out


def save_head(directory, tensors: dict, config: dict) -> Path:
    """Writes a head as published: model.safetensors (the names above) and config.json."""
    from safetensors.torch import save_file

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    save_file({n: t.detach().contiguous().cpu() for n, t in tensors.items()}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return out
