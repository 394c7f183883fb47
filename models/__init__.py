"""Model families built from atoll's sharded layers."""

from atoll.errors import ConfigError
from atoll.models.config import DENSE_TYPES, SUPPORTED, ModelConfig

RUNNABLE = DENSE_TYPES + ("mixtral", "qwen2_moe", "qwen3_moe", "deepseek_v2", "deepseek_v3")


def build_model(config: ModelConfig, ctx, *, dtype=None, device=None, engine=None):
    """This rank's part of the model on `device` (default: ctx.device), parameters allocated
    there but not loaded; `engine` (an EngineConfig) the run's switches its MoE layers take
    (None: the defaults)."""
    import torch  # lazy: importing any atoll.models.<module> runs this file; config, presets stay torch-free

    with torch.device(device or ctx.device):
        return _build(config, ctx, dtype or torch.float32, engine)


def _build(config: ModelConfig, ctx, dtype, engine):
    if config.model_type in DENSE_TYPES:
        from atoll.models.llama import LlamaForCausalLM  # lazy: torch and every layer, as above

        return LlamaForCausalLM(config, ctx, dtype=dtype)
    if config.model_type in ("mixtral", "qwen2_moe", "qwen3_moe"):
        from atoll.models.moe import MoeForCausalLM  # lazy: torch and every layer, as above

        return MoeForCausalLM(config, ctx, dtype=dtype, engine=engine)
    if config.model_type in ("deepseek_v2", "deepseek_v3"):
        from atoll.models.deepseek import DeepseekForCausalLM  # lazy: torch and every layer, as above

        return DeepseekForCausalLM(config, ctx, dtype=dtype, engine=engine)
    raise ConfigError(f"model type {config.model_type!r} is recognised but not runnable; "
                      f"runnable: {', '.join(RUNNABLE)}")


__all__ = ["ModelConfig", "SUPPORTED", "build_model"]
