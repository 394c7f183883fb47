"""The living engine's rank loop: every rank builds its stage once, then loops until told to
stop. Each pass, rank 0 takes what the driver sent since the last one (requests to add,
ids to abort, stop) and broadcasts it, so every rank adds and aborts the same requests at the
same tick; every rank runs one tick of its EngineCore; rank 0 sends the driver the tokens each
request took, the requests that ended and the engine's counters. With DP each replica's
leader knows only its own replica's tokens: they are gathered on rank 0 every pass.

When nothing runs anywhere, rank 0 waits for the driver up to IDLE_S before broadcasting, so
an idle engine costs one small collective per IDLE_S (well inside the collective timeout).

Messages. Driver -> rank 0 (inbox): ("add", Request, replica), ("abort", index), ("stop",).
Rank 0 -> driver (outbox): ("ready", info) once the ranks are built, then ("step", tokens,
finished, stats) whenever a pass produced something or the counters changed: tokens
[(index, token)], finished [(index, result)], stats {running, waiting, blocks_in_use,
num_blocks, ...}.
"""

from __future__ import annotations

import queue

import torch.distributed as dist

from atoll.engine.core import EngineCore
from atoll.engine.runner import ModelRunner, RunSpec
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ContextOptions, ParallelContext

IDLE_S = 0.5


def serve_worker(rank: int, world_size: int, spec: RunSpec, inbox, outbox, parallel: ContextOptions | None = None,
                 device: str = "cpu", node: str | None = None, ranks_here: int | None = None) -> None:
    layout = Layout.parse(spec.layout)
    ctx = ParallelContext.create(layout, rank, device, parallel, node=node) if world_size > 1 \
        else ParallelContext.single(device, parallel)
    runner = ModelRunner(spec, ctx, ranks_here=ranks_here)
    finished: list = []
    core = EngineCore(runner, on_finish=lambda index, result: finished.append((index, result)))
    leader = ctx.coords.tp == 0 and ctx.is_first_stage  # holds its replica's tokens
    if rank == 0:
        outbox.put(("ready", {"num_blocks": runner.num_blocks, "block_size": spec.engine.block_size,
                              "max_model_len": spec.max_model_len, "replicas": layout.dp,
                              "max_num_seqs": spec.engine.max_num_seqs}))
    runner.start_run()
    last = None
    while True:
        commands = _take(inbox, wait=not core.busy) if rank == 0 else None
        if world_size > 1:
            box = [commands]
            dist.broadcast_object_list(box, src=0)
            commands = box[0]
        if _apply(core, commands, ctx.coords.dp):
            break
        core.step()
        mine = (core.drain(), finished[:], _stats(core)) if leader else ([], [], None)
        finished.clear()
        parts = _gather(mine, rank, world_size, layout.dp)
        if rank == 0:
            tokens = [t for p in parts for t in p[0]]
            done = [f for p in parts for f in p[1]]
            stats = _sum([p[2] for p in parts if p[2] is not None])
            if tokens or done or stats != last:
                outbox.put(("step", tokens, done, stats))
                last = stats
    runner.end_run()


def _take(inbox, *, wait: bool) -> list:
    """Every message waiting in the inbox; when `wait`, block up to IDLE_S for the first."""
    out = []
    try:
        out.append(inbox.get(timeout=IDLE_S) if wait else inbox.get_nowait())
        while True:
            out.append(inbox.get_nowait())
    except queue.Empty:
        pass
    return out


def _apply(core: EngineCore, commands: list, replica: int) -> bool:
    """Add and abort as the driver asked; True when it asked to stop."""
    for cmd in commands:
        if cmd[0] == "add":
            if cmd[2] == replica:
                core.add(cmd[1])
        elif cmd[0] == "abort":
            core.abort(cmd[1])
        elif cmd[0] == "stop":
            return True
    return False


def _stats(core: EngineCore) -> dict:
    lanes = core.lanes.schedulers
    return {"running": sum(len(s.running) for s in lanes), "waiting": sum(len(s.waiting) for s in lanes),
            "blocks_in_use": core.blocks_in_use(), "blocks_cached": core.cached_blocks(),
            "num_blocks": sum(s.pool.num_blocks for s in lanes)}


def _sum(parts: list[dict]) -> dict | None:
    """The replicas' counters added up."""
    return {k: sum(p[k] for p in parts) for k in parts[0]} if parts else None


def _gather(mine, rank: int, world_size: int, dp: int) -> list:
    """Every replica leader's (tokens, finished, stats) on rank 0; with one replica rank 0 is
    its leader and nothing moves."""
    if dp == 1:
        return [mine] if rank == 0 else []
    parts = [None] * world_size if rank == 0 else None
    dist.gather_object(mine, parts, dst=0)
    return parts if rank == 0 else []
