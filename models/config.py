"""ModelConfig: the numbers atoll needs from a Hugging Face config.json, validated once."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from atoll.errors import ConfigError
from atoll.models.jsonfile import read_json_object
from atoll.models.safetensors_header import tensor_names

DENSE_TYPES = ("llama", "mistral", "qwen2", "qwen3")
MOE_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")
SUPPORTED = DENSE_TYPES + MOE_TYPES
_POSITIVE = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "max_position_embeddings")


def _windows(d: dict, mt: str) -> dict:
    """sliding_window and layer_windows as transformers reads them: the window applies where
    use_sliding_window (default: Mistral only), to the layers config.json's layer_types mark
    "sliding_attention", else (Qwen2/3) to the layers from max_window_layers on, else to all."""
    window = d.get("sliding_window") if d.get("use_sliding_window", mt == "mistral") else None
    n = d["num_hidden_layers"]
    if not window:
        return {"sliding_window": None, "layer_windows": None}
    types = d.get("layer_types")
    if not isinstance(types, list) or len(types) != n:
        first = d.get("max_window_layers") if mt.startswith(("qwen2", "qwen3")) else None
        types = ["sliding_attention" if first is None or i >= first else "full_attention" for i in range(n)]
    windows = tuple(window if t == "sliding_attention" else None for t in types)
    if all(w == window for w in windows):
        return {"sliding_window": window, "layer_windows": None}
    return {"sliding_window": None, "layer_windows": windows}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    max_position_embeddings: int = 4096
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    qk_norm: bool = False
    sliding_window: int | None = None  # every layer's window (Mistral); None when any layer has none
    # each layer's window where they differ (Qwen2/3's max_window_layers, config.json's
    # layer_types): None for a full-attention layer; None here when every layer is alike
    layer_windows: tuple | None = None
    # MoE (num_experts == 0 means dense)
    num_experts: int = 0
    num_experts_per_tok: int = 0
    moe_intermediate_size: int = 0
    shared_expert_intermediate_size: int = 0
    first_k_dense_replace: int = 0
    norm_topk_prob: bool = True
    scoring: str = "softmax"  # router scores: softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3)
    n_group: int = 1  # DeepSeek-V3 group-limited routing: experts in n_group groups,
    topk_group: int = 1  # tokens pick experts only from their topk_group best groups
    routed_scaling_factor: float = 1.0
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    # MLA (DeepSeek); kv_lora_rank == 0 means ordinary multi-head / grouped-query attention
    kv_lora_rank: int = 0
    q_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    qk_nope_head_dim: int = 0
    v_head_dim: int = 0
    rope_interleave: bool = False  # rotary dims in pairs (x0, x1), (x2, x3), ...: DeepSeek's layout
    bos_token_id: int | None = None
    eos_token_id: tuple[int, ...] = ()
    raw: dict = field(default_factory=dict, repr=False, compare=False, hash=False)

    def __post_init__(self):
        self._check_types()  # and the _POSITIVE fields >= 1
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_key_value_heads={self.num_key_value_heads} does not divide "
                f"num_attention_heads={self.num_attention_heads}"
            )
        if self.model_type.startswith("deepseek") and not self.is_mla:
            raise ConfigError(f"{self.model_type} needs kv_lora_rank >= 1 (its MLA latent), got {self.kv_lora_rank}")
        if self.is_mla and (self.qk_rope_head_dim < 2 or self.qk_rope_head_dim % 2 or self.v_head_dim < 1):
            raise ConfigError(f"MLA needs an even qk_rope_head_dim >= 2 and v_head_dim >= 1, got "
                              f"qk_rope_head_dim={self.qk_rope_head_dim}, v_head_dim={self.v_head_dim}")
        if self.is_moe and not 0 < self.num_experts_per_tok <= self.num_experts:
            raise ConfigError(
                f"top-k num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                f"num_experts={self.num_experts}"
            )

    def _check_types(self) -> None:
        """Each field holds what its annotation says (JSON may hold anything)."""
        def whole(v, least=0):
            return isinstance(v, int) and not isinstance(v, bool) and v >= least

        for f in fields(self):
            v, kind = getattr(self, f.name), f.type
            least = 1 if f.name in _POSITIVE else 0
            if kind == "int" and not whole(v, least):
                raise ConfigError(f"{f.name}={v!r} must be a whole number >= {least}")
            if kind == "int | None" and v is not None and not whole(v):
                raise ConfigError(f"{f.name}={v!r} must be a whole number >= 0 or null")
            if kind.startswith("tuple[int") and not all(whole(x) for x in v):
                raise ConfigError(f"{f.name}={list(v)!r} must be whole numbers >= 0")
            if kind == "float" and (isinstance(v, bool) or not isinstance(v, (int, float))
                                    or not math.isfinite(v)):
                raise ConfigError(f"{f.name}={v!r} must be a finite number")
            if kind == "dict | None" and v is not None and not isinstance(v, dict):
                raise ConfigError(f"{f.name}={v!r} must be a JSON object or null")

    def window_of(self, layer: int) -> int | None:
        """Layer `layer`'s sliding window (None: it attends to every position)."""
        return self.layer_windows[layer] if self.layer_windows is not None else self.sliding_window

    @property
    def pool_window(self) -> int | None:
        """The window every layer keeps within (the widest when they differ), when every layer
        slides: blocks before it go back to the pool (engine.batch.scheduler). None if any layer
        attends to every position."""
        if self.layer_windows is None:
            return self.sliding_window
        return None if None in self.layer_windows else max(self.layer_windows)

    @property
    def hybrid_window(self) -> int | None:
        """The widest sliding window when some layers slide and others attend to every position
        (Qwen2/3's max_window_layers, config.json's layer_types): the sliding layers can keep
        their own, shorter block tables (engine.kv.windowed). None otherwise."""
        if self.layer_windows is None or None not in self.layer_windows:
            return None
        return max((w for w in self.layer_windows if w is not None), default=None)

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    def is_moe_layer(self, i: int) -> bool:
        """Whether decoder layer i has routed experts (the rest use a dense MLP)."""
        if not self.is_moe or i in self.mlp_only_layers or i < self.first_k_dense_replace:
            return False
        return (i + 1) % self.decoder_sparse_step == 0

    @property
    def is_mla(self) -> bool:
        return self.kv_lora_rank > 0

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        mt = d.get("model_type")
        if mt not in SUPPORTED:
            archs = d.get("architectures")
            arch = archs[0] if isinstance(archs, list) and archs else mt
            raise ConfigError(
                f"unsupported architecture {arch!r} (model_type={mt!r}); "
                f"supported model types: {', '.join(SUPPORTED)}"
            )
        need = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads")
        missing = [k for k in need if k not in d]
        if missing:
            raise ConfigError(f"model config lacks {', '.join(missing)}")
        for k in ("hidden_size", "num_attention_heads"):  # head_dim below divides one by the other
            v = d[k]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{k}={v!r} must be a whole number >= 1")
        heads = d["num_attention_heads"]
        kv = d.get("num_key_value_heads") or heads
        head_dim = d.get("head_dim") or d["hidden_size"] // heads
        eos = d.get("eos_token_id")
        eos = tuple(eos) if isinstance(eos, list) else (() if eos is None else (eos,))
        rope_params = d.get("rope_parameters") or {}
        if not isinstance(rope_params, dict):
            raise ConfigError(f"rope_parameters={rope_params!r} must be a JSON object")
        rope_theta = d.get("rope_theta", rope_params.get("rope_theta", 10000.0))
        if isinstance(rope_theta, bool) or not isinstance(rope_theta, (int, float)):
            raise ConfigError(f"rope_theta={rope_theta!r} must be a number")
        scaling = d.get("rope_scaling")
        if scaling is None and rope_params.get("rope_type", "default") != "default":
            scaling = dict(rope_params)
        kw = dict(
            model_type=mt,
            vocab_size=d["vocab_size"],
            hidden_size=d["hidden_size"],
            intermediate_size=d.get("intermediate_size", 0),
            num_hidden_layers=d["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=kv,
            head_dim=head_dim,
            max_position_embeddings=d.get("max_position_embeddings", 4096),
            rms_norm_eps=d.get("rms_norm_eps", 1e-6),
            rope_theta=float(rope_theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
            attention_bias=bool(d.get("attention_bias", mt in ("qwen2", "qwen2_moe"))),
            qk_norm=mt in ("qwen3", "qwen3_moe"),
            **_windows(d, mt),
            bos_token_id=d.get("bos_token_id"),
            eos_token_id=eos,
            raw=d,
        )
        try:
            cls._moe_fields(mt, d, kw, head_dim)
        except KeyError as e:
            raise ConfigError(f"model config for {mt} lacks the field {e.args[0]!r}") from None
        except (TypeError, ValueError) as e:  # e.g. null where a number belongs
            raise ConfigError(f"model config for {mt} has a field of the wrong type: {e}") from None
        try:
            return cls(**kw)
        except (TypeError, KeyError) as e:
            raise ConfigError(f"model config for {mt} is incomplete: {e}") from None

    @staticmethod
    def _moe_fields(mt: str, d: dict, kw: dict, head_dim: int) -> None:
        if mt == "mixtral":
            kw.update(num_experts=d["num_local_experts"], num_experts_per_tok=d["num_experts_per_tok"],
                      moe_intermediate_size=d["intermediate_size"])
        elif mt in ("qwen2_moe", "qwen3_moe"):
            experts = d.get("num_experts") or d.get("num_local_experts")  # transformers 5 renamed it
            if experts is None:
                raise KeyError("num_experts")
            kw.update(num_experts=experts, num_experts_per_tok=d["num_experts_per_tok"],
                      moe_intermediate_size=d["moe_intermediate_size"],
                      shared_expert_intermediate_size=d.get("shared_expert_intermediate_size", 0),
                      norm_topk_prob=bool(d.get("norm_topk_prob", mt == "qwen3_moe")),
                      decoder_sparse_step=d.get("decoder_sparse_step", 1) or 1,
                      mlp_only_layers=tuple(d.get("mlp_only_layers") or ()))
        elif mt in ("deepseek_v2", "deepseek_v3"):
            v3 = mt == "deepseek_v3"
            # V2 as transformers runs it: softmax top-k, never renormalised; groups only for
            # group_limited_greedy. V3: sigmoid scores, noaux_tc group-limited top-k.
            grouped = v3 or d.get("topk_method") == "group_limited_greedy"
            kw.update(num_experts=d["n_routed_experts"], num_experts_per_tok=d["num_experts_per_tok"],
                      moe_intermediate_size=d["moe_intermediate_size"],
                      shared_expert_intermediate_size=d["moe_intermediate_size"] * d.get("n_shared_experts",
                                                                                         1 if v3 else 2),
                      first_k_dense_replace=d.get("first_k_dense_replace", 0),
                      norm_topk_prob=bool(d.get("norm_topk_prob", True)) if v3 else False,
                      scoring="sigmoid" if v3 else "softmax",
                      n_group=(d.get("n_group") or 1) if grouped else 1,
                      topk_group=(d.get("topk_group") or 1) if grouped else 1,
                      routed_scaling_factor=float(d.get("routed_scaling_factor", 1.0)),
                      kv_lora_rank=d.get("kv_lora_rank", 0), q_lora_rank=d.get("q_lora_rank") or 0,
                      qk_rope_head_dim=d.get("qk_rope_head_dim", 0),
                      qk_nope_head_dim=d.get("qk_nope_head_dim", 0),
                      v_head_dim=d.get("v_head_dim", 0),
                      rope_interleave=bool(d.get("rope_interleave", True)) if v3 else True,
                      head_dim=d.get("qk_rope_head_dim", 0) + d.get("qk_nope_head_dim", 0) or head_dim)

    @classmethod
    def load(cls, path: str | Path) -> "ModelConfig":
        """From a checkpoint directory or a config.json file."""
        p = Path(path)
        f = p / "config.json" if p.is_dir() else p
        if not f.exists():
            raise ConfigError(f"no config.json at {p}")
        if not f.is_file():
            raise ConfigError(f"{f} is a directory, not a config.json file")

        d = read_json_object(f, ConfigError)
        try:
            config = cls.from_dict(d)
            if config.tie_word_embeddings and p.is_dir():
                # a tied model that still stores its own lm_head.weight: transformers then keeps
                # that tensor as the head (it ties only when the two are equal), and so does atoll
                if "lm_head.weight" in tensor_names(p):
                    config = replace(config, tie_word_embeddings=False)
            return config
        except KeyError as e:
            raise ConfigError(f"model config {f} lacks the field {e.args[0]!r}") from None
        except ConfigError as e:
            raise ConfigError(f"{f}: {e}") from None
