"""The inference engine: sampling, the generation loop, and the LLM API."""

from atoll.engine.llm import LLM, RequestOutput
from atoll.engine.sampling import SamplingParams

__all__ = ["LLM", "RequestOutput", "SamplingParams"]
