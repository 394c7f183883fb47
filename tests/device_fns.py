"""Rank functions for the device tests (module level, so spawned ranks import them)."""


def generate_on_meta_default(rank: int, world_size: int, spec, requests, sampled: bool = False):
    """engine.worker's one-shot job with torch's default device set to `meta`: any tensor the runtime makes
    without naming the rank's device lands on meta and fails at its first use (a collective,
    a copy, an index into a real tensor), so the run finishing proves every creation site
    names the device. Returns rank 0's results (and every rank's bound device)."""
    import torch

    from atoll.engine.rank.job import EngineJob
    from atoll.engine.worker import worker
    from atoll.launch.device import rank_device

    torch.set_default_device("meta")
    results = worker(rank, world_size, EngineJob.colocated(spec), requests=requests)
    return {"results": results, "device": rank_device(), "default": str(torch.get_default_device())}
