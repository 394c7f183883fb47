"""`atoll.LLM`: the engine's LLM handed a launcher, the local one unless another is given."""

from __future__ import annotations

from atoll.engine.llm import LLM as EngineLLM
from atoll.launch.local import LocalJob, channel, run_local


class LocalLauncher:
    """Ranks as processes of this machine (launch.local): called, one job run to its end;
    start(), a lasting job (the living engine's), watched by its check()."""

    def __call__(self, fn, world_size: int, *args, **kwargs) -> list:
        return run_local(fn, world_size, *args, **kwargs)

    def start(self, fn, world_size: int, *args, **kwargs) -> LocalJob:
        return LocalJob(fn, world_size, *args, **kwargs)

    channel = staticmethod(channel)


class LLM(EngineLLM):
    """engine.llm.LLM whose ranks are local processes (LocalLauncher), unless `launcher` is
    given: an object like LocalLauncher, or any callable launcher(fn, world_size, *args,
    device=..., timeout_s=..., **kwargs) returning every rank's value (one job per call)."""

    def __init__(self, model, *, launcher=None, **kwargs):
        super().__init__(model, launcher=launcher or LocalLauncher(), **kwargs)
