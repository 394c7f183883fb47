"""Built-in model configs: the numbers of each model's published Hugging Face config.json,
kept as HF-style dicts and read through ModelConfig.from_dict like any checkpoint's config.

`resolve_model(name_or_path)` takes a preset name (case-insensitive, with or without the
org prefix: "DeepSeek-V3", "deepseek-ai/DeepSeek-V3") or a config directory or file.
"""

from __future__ import annotations

from pathlib import Path

from atoll.errors import ConfigError
from atoll.models.config import ModelConfig

_LLAMA31_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                 "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _llama31(hidden, inter, layers, heads):
    # meta-llama/Llama-3.1-*: vocab 128256, 8 KV heads, rope_theta 500000, 128k context
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 128256,
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": 128,
            "max_position_embeddings": 131072, "rms_norm_eps": 1e-5, "rope_theta": 500000.0,
            "rope_scaling": dict(_LLAMA31_ROPE), "tie_word_embeddings": False,
            "bos_token_id": 128000, "eos_token_id": [128001, 128008, 128009], "torch_dtype": "bfloat16"}


def _mixtral(hidden, inter, layers, heads, vocab, ctx):
    # mistralai/Mixtral-*: 8 experts, top-2, 8 KV heads, rope_theta 1e6
    return {"model_type": "mixtral", "architectures": ["MixtralForCausalLM"], "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": inter, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": 8, "num_local_experts": 8,
            "num_experts_per_tok": 2, "max_position_embeddings": ctx, "rms_norm_eps": 1e-5,
            "rope_theta": 1e6, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "torch_dtype": "bfloat16"}


def _qwen3_moe(hidden, inter, moe_inter, layers, heads, kv):
    # Qwen/Qwen3-*-A*B: 128 experts, top-8, head_dim 128, no shared expert, vocab 151936
    return {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936,
            "hidden_size": hidden, "intermediate_size": inter, "moe_intermediate_size": moe_inter,
            "num_hidden_layers": layers, "num_attention_heads": heads, "num_key_value_heads": kv,
            "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": True,
            "decoder_sparse_step": 1, "mlp_only_layers": [], "max_position_embeddings": 40960,
            "rms_norm_eps": 1e-6, "rope_theta": 1e6, "tie_word_embeddings": False,
            "bos_token_id": 151643, "eos_token_id": 151645, "torch_dtype": "bfloat16"}


# deepseek-ai/DeepSeek-V3 config.json (MLA, 256 routed + 1 shared expert, group-limited top-8)
_DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 129280,
    "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "num_attention_heads": 128, "num_key_value_heads": 128,
    "n_routed_experts": 256, "n_shared_experts": 1, "num_experts_per_tok": 8,
    "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4,
    "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "topk_method": "noaux_tc",
    "norm_topk_prob": True, "kv_lora_rank": 512, "q_lora_rank": 1536, "qk_rope_head_dim": 64,
    "qk_nope_head_dim": 128, "v_head_dim": 128, "num_nextn_predict_layers": 1,
    "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000,
    "rope_scaling": {"type": "yarn", "factor": 40, "original_max_position_embeddings": 4096,
                     "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
    "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1, "torch_dtype": "bfloat16",
    "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128]},
}

PRESETS: dict[str, dict] = {
    "Llama-3.1-8B": _llama31(4096, 14336, 32, 32),
    "Llama-3.1-70B": _llama31(8192, 28672, 80, 64),
    "Llama-3.1-405B": _llama31(16384, 53248, 126, 128),
    "Mixtral-8x7B": _mixtral(4096, 14336, 32, 32, 32000, 32768),
    "Mixtral-8x22B": _mixtral(6144, 16384, 56, 48, 32768, 65536),
    "Qwen3-30B-A3B": _qwen3_moe(2048, 6144, 768, 48, 32, 4),
    "Qwen3-235B-A22B": _qwen3_moe(4096, 12288, 1536, 94, 64, 4),
    "DeepSeek-V3": _DEEPSEEK_V3,
}


def preset_dict(name: str) -> dict:
    key = name.split("/")[-1].lower()
    for k, v in PRESETS.items():
        if k.lower() == key:
            return dict(v)
    raise ConfigError(f"unknown model {name!r}; built-in presets: {', '.join(PRESETS)} "
                      "(or give a Hugging Face config directory or config.json)")


def resolve_model(name_or_path: str) -> tuple[str, ModelConfig]:
    """(display name, ModelConfig) from a preset name or a config directory/file."""
    p = Path(name_or_path)
    if p.exists():
        return (p.name if p.is_dir() else p.parent.name or p.stem), ModelConfig.load(p)
    d = preset_dict(name_or_path)
    key = name_or_path.split("/")[-1].lower()
    return next(k for k in PRESETS if k.lower() == key), ModelConfig.from_dict(d)
