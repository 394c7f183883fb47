"""`atoll.LLM`: the engine's LLM handed a launcher, the local one unless another is named."""

from __future__ import annotations

from atoll.engine.llm import LLM as EngineLLM
from atoll.launch.local import run_local


class LLM(EngineLLM):
    """engine.llm.LLM whose ranks are local processes (launch.local), unless `launcher` is
    given: any callable launcher(fn, world_size, *args, device=..., timeout_s=..., **kwargs)
    returning every rank's value."""

    def __init__(self, model, *, launcher=None, **kwargs):
        super().__init__(model, launcher=launcher or run_local, **kwargs)

