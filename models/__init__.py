"""Model families built from atoll's sharded layers."""

from atoll.models.config import DENSE_TYPES, SUPPORTED, ModelConfig


def build_model(config: ModelConfig, ctx, *, dtype=None):
    """This rank's part of the model, parameters allocated but not loaded."""
    import torch

    from atoll.errors import ConfigError

    dtype = dtype or torch.float32
    if config.model_type in DENSE_TYPES:
        from atoll.models.llama import LlamaForCausalLM

        return LlamaForCausalLM(config, ctx, dtype=dtype)
    raise ConfigError(f"model type {config.model_type!r} is recognised but not runnable yet; "
                      f"runnable: {', '.join(DENSE_TYPES)}")


__all__ = ["ModelConfig", "SUPPORTED", "build_model"]
