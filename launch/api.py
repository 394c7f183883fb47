"""`atoll.LLM`: the engine's LLM handed a launcher, the local one unless another is given.
Each launcher here runs one job per call and starts lasting ones (the living engine's):
LocalLauncher (processes of this machine), RayLauncher (Ray actors across a cluster) and
launch.rank_job.RankLauncher (this process is one rank of a torchrun / mpirun job)."""

from __future__ import annotations

from dataclasses import asdict

from atoll.config import from_args
from atoll.engine.driver.llm import LLM as EngineLLM
from atoll.launch.local import LocalJob, channel, run_local
from atoll.launch.rank_job import RankLauncher
from atoll.launch.ray_launcher import RayJob, _import_ray, run_ray
from atoll.launch.ray_launcher import channel as ray_channel

__all__ = ["LLM", "LocalLauncher", "RankLauncher", "RayLauncher"]


class LocalLauncher:
    """Ranks as processes of this machine (launch.local): called, one job run to its end;
    start(), a lasting job (the living engine's), watched by its check()."""

    def __call__(self, fn, world_size: int, *args, **kwargs) -> list:
        return run_local(fn, world_size, *args, **kwargs)

    def start(self, fn, world_size: int, *args, **kwargs) -> LocalJob:
        return LocalJob(fn, world_size, *args, **kwargs)

    channel = staticmethod(channel)
    disaggregates = True  # a living disaggregated engine's two engines are one job here
    elastic = True  # a living engine's job can give a dead rank up and go on (--elastic-ep)


class RayLauncher:
    """Ranks as Ray actors (launch.ray_launcher), one job per call or a lasting RayJob from
    start(); channels are Ray queues. address: the cluster (None: start Ray on this machine);
    placement / strict_placement: a plan's rank -> (node, GPU); tp_size: without a placement,
    each TP group on one node; parallel: the ranks' ContextOptions (a plan's islands and
    nodes), in place of the caller's; the rest are RayJob's keywords (ranks_per_node, ...)."""

    def __init__(self, *, address: str | None = None, placement=None, strict_placement: bool = False,
                 tp_size: int = 1, parallel=None, **options):
        self.parallel = parallel
        self.options = dict(address=address, placement=placement, strict_placement=strict_placement,
                            tp_size=tp_size, **options)

    def _kwargs(self, kwargs: dict) -> dict:
        if self.parallel is not None and "parallel" in kwargs:
            kwargs = {**kwargs, "parallel": self.parallel}
        return {**self.options, **kwargs}

    def __call__(self, fn, world_size: int, *args, **kwargs) -> list:
        return run_ray(fn, world_size, *args, **self._kwargs(kwargs))

    def start(self, fn, world_size: int, *args, **kwargs) -> RayJob:
        return RayJob(fn, world_size, *args, **self._kwargs(kwargs))

    channel = staticmethod(ray_channel)
    disaggregates = True  # prefill and decode engines' actors are one job, each TP group on a node
    elastic = True  # RayJob.give_up kills a rank's actor and the job goes on (--elastic-ep)

    def driver_host(self) -> str:
        """The address the ranks reach a server of this process at (--elastic-ep's store): this
        node's address as Ray names it, 127.0.0.1 where Ray is to be started here."""
        ray = _import_ray()
        if self.options.get("address") is None and not ray.is_initialized():
            return "127.0.0.1"  # launch.ray_cluster.connect starts it on the loopback
        return ray.util.get_node_ip_address()


class LLM(EngineLLM):
    """engine.driver.llm.LLM whose ranks are local processes (LocalLauncher), unless `launcher` is
    given: an object like LocalLauncher (RayLauncher, RankLauncher), or any callable
    launcher(fn, world_size, *args, device=..., timeout_s=..., **kwargs) returning every
    rank's value (one job per call)."""

    def __init__(self, model, *, launcher=None, **kwargs):
        super().__init__(model, launcher=launcher or LocalLauncher(), **kwargs)


def llm_from_args(args, model_dir, layout=None, **kwargs) -> LLM:
    """The LLM that parsed flags (config.add_model_options) describe; `layout` in place of theirs.
    A saved plan's (args.saved_plan) MoE options fill the engine options the flags left off."""
    options = asdict(from_args(args))
    plan = getattr(args, "saved_plan", None)
    for name, value in (plan.engine_options() if plan is not None else {}).items():
        if not options.get(name):
            options[name] = value
    return LLM(model_dir, layout=layout or args.layout, tensor_parallel_size=args.tensor_parallel_size,
               pipeline_parallel_size=args.pipeline_parallel_size, data_parallel_size=args.data_parallel_size,
               expert_parallel_size=args.expert_parallel_size,
               context_parallel_size=getattr(args, "context_parallel_size", None), **options, **kwargs)
