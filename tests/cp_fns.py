"""Rank functions for the context parallel tests (module level, so spawned ranks import them)."""

from atoll import SamplingParams
from atoll.engine.rank.core import EngineCore
from atoll.engine.batch.request import Request
from atoll.engine.rank.run_spec import RunSpec
from atoll.engine.rank.runner import ModelRunner
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext


def held_kv(rank: int, world_size: int, model_dir: str, layout: str, prompt: list[int], block_size: int) -> dict:
    """Prefill one prompt and read, from this rank's cache objects, what its sequence holds
    here: the blocks of its table living on this rank and their bytes (blocks x the cache's
    bytes per token x block size), with the cache's whole size."""
    lay = Layout.parse(layout)
    ctx = ParallelContext.create(lay, rank) if world_size > 1 else ParallelContext.single()
    spec = RunSpec.of(model_dir, layout, max_model_len=len(prompt) + 2, block_size=block_size, max_num_seqs=1)
    runner = ModelRunner(spec, ctx)
    core = EngineCore(runner)
    core.add(Request(0, list(prompt), SamplingParams(max_tokens=2, ignore_eos=True)))
    seq = core.sequences[0]
    runner.start_run()
    while not seq.output:
        core.step()
    cp, me = lay.cp, ctx.coords.cp
    here = [b // cp for j, b in enumerate(seq.blocks) if j % cp == me and b % cp == me]
    cache = runner.cache
    # the blocks this rank wrote (the scratch block, past num_blocks, left out): its own share only
    written = int((cache.k[0][:runner.num_blocks].flatten(1).abs().sum(1) > 0).sum())
    return {"cp_rank": me, "blocks": len(seq.blocks), "here": len(here), "written": written,
            "striped": all(b % cp == j % cp for j, b in enumerate(seq.blocks)),
            "held_bytes": len(here) * cache.bytes_per_token * block_size, "cache_bytes": cache.bytes}
