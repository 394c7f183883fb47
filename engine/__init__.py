"""The inference engine: sampling, the generation loop, and the LLM API."""

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name):
    # Lazy (PEP 562): `atoll.engine.config` is read to build the CLI, which must not import torch.
    if name in ("LLM", "RequestOutput"):
        from atoll.engine import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from atoll.engine.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'atoll.engine' has no attribute {name!r}")
