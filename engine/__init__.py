"""The inference engine: sampling, the generation loop, and the LLM API."""

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name):
    # lazy (PEP 562): importing any atoll.engine.<module> runs this file, and LLM brings the whole
    # runtime (torch, models, layers); engine.kv.blocks and engine.batch.tokenizer stay torch-free
    if name in ("LLM", "RequestOutput"):
        from atoll.engine.driver import llm

        return getattr(llm, name)
    if name == "SamplingParams":
        from atoll.config.sampling import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'atoll.engine' has no attribute {name!r}")
