"""atoll: multi-node model-parallel inference for large language models."""

from atoll.errors import AtollError

__version__ = "0.1.0"

__all__ = ["AtollError", "LLM", "SamplingParams", "Layout", "__version__"]


def __getattr__(name):
    # Lazy so `import atoll` stays cheap and never imports torch.distributed eagerly.
    if name == "LLM":  # the engine's LLM with the local launcher
        from atoll.launch.api import LLM

        return LLM
    if name == "SamplingParams":
        from atoll.engine.sample.sampler import SamplingParams

        return SamplingParams
    if name == "Layout":
        from atoll.parallel.layout import Layout

        return Layout
    raise AttributeError(f"module 'atoll' has no attribute {name!r}")
