"""A one-shot DP-attention/EP run that goes on without a lost rank (elastic EP): DP4EP4 loses a
rank and finishes as DP3EP3 (launch/elastic.py starts it and gives the dead rank up).

Every rank runs the one rank loop (engine/rank/loop.py) over the requests. When a collective
fails (a peer died: gloo says so at once; a peer hung: the group's collective timeout), each
survivor says so in the elastic store that the engine's rank 0 serves (comm/regroup.py); rank 0
waits for the notices, names the survivors, and every survivor tears its process groups down and
joins the next round's, at the shrunk layout (Layout.shrunk). Before rebuilding, each survivor
checks that every MoE layer's experts still have a source (comm.elastic.survive_layers: a copy
on a survivor, else the checkpoint); one with none stops the run with the line naming it.

The survivors then build their stage again for the new layout with every MoE layer's kept slots
and fill it from the stage before the loss (engine/rank/elastic.py's `carry`: the weights kept,
the experts without a copy read from the checkpoint), when every layer kept one slot count and
split; else (layers rebalanced apart, quantized weights) it reads the checkpoint again. Rank 0
adds every request that had not ended, with the tokens it had taken so far (Request.generated,
the migration's own field), spread over the new DP replicas, so each goes on from its last token.

Rank 0 is the run's link to the driver and serves the elastic store: its loss ends the run.
"""

from __future__ import annotations

import dataclasses
import time

import torch.distributed as dist

from atoll.comm import regroup
from atoll.comm.elastic import survive_layers
from atoll.engine.batch.request import Request
from atoll.comm.experts import expert_split
from atoll.engine.rank.elastic import carry, checkpoint_has
from atoll.engine.rank.loop import Batch, ServeLoop
from atoll.engine.rank.run_spec import RunSpec
from atoll.engine.rank.runner import ModelRunner
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext


class _Record:
    """Rank 0's outbox: the finished results (in the Batch) and every request's tokens so far."""

    def __init__(self, batch: Batch, tokens: dict[int, list[int]]):
        self.batch, self.tokens = batch, tokens
        self.last = time.monotonic()  # when the last step's report came (rank 0)

    def put(self, msg) -> None:
        self.last = time.monotonic()
        if msg[0] == "step":
            for index, token, *_ in msg[1]:
                self.tokens.setdefault(index, []).append(token)
        self.batch.put(msg)


def elastic_worker(rank: int, world_size: int, spec: RunSpec, requests: list[Request], *, timeout_s: float = 10.0,
                   device: str = "cpu", node: str | None = None):
    """This rank's part of the run; rank 0 returns {"results": one per request, in order,
    "layouts": the layout of each round, "recoveries": [{"lost", "noticed_s", "rebuilt_s"}]}."""
    layout = Layout.parse(spec.layout)
    # rank 0 names the survivors once all but one noticed, or after timeout_s: a survivor still
    # blocked in a collective notices only at its group's timeout (at most timeout_s after a round
    # starts; the first round's is the collective timeout, ATOLL_COLLECTIVE_TIMEOUT_S)
    word_s = 2 * timeout_s + 10
    store = _elastic_store(rank)
    me, ranks, round_ = rank, list(range(world_size)), 0
    ctx = ParallelContext.create(layout, me, device, node=node)
    runner = ModelRunner(spec, ctx)
    results: dict[int, dict] = {}
    tokens: dict[int, list[int]] = {}
    todo, layouts, recoveries = list(requests), [str(layout)], []
    while True:
        dp = layout.dp
        batch = Batch(todo, lambda k: k % dp)
        record = _Record(batch, tokens)
        loop = ServeLoop(runner, batch, record)
        try:
            loop.ready()
            loop.run()
            results |= batch.results
            break
        except RuntimeError as e:  # a collective failed: a peer is gone
            failed_at = time.monotonic()
            if len(ranks) == 1:
                raise
            cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        results |= batch.results
        regroup.notice(store, round_, me)
        regroup.leave()  # the peers still in a collective with this rank fail at once, and notice
        if me == 0:
            # past the collective timeout: a survivor blocked in a collective notices only then
            keep = regroup.elect(store, round_, ranks, timeout_s + 5)
            regroup.announce(store, round_ + 1, keep)
        else:
            keep = regroup.survivors(store, round_ + 1, word_s)
        lost = [r for r in range(len(ranks)) if r not in keep]
        # every expert keeps a source, or the run stops naming the one without (before any rebuild)
        placements = {lid: m.placement for lid, m in zip(runner.model.moe_layer_ids, runner.model.moe_layers)}
        kept = survive_layers(placements, lost, checkpoint_has(runner.model, runner.checkpoint)) if placements else {}
        noticed = time.monotonic() - failed_at
        old, old_rank = runner.model, me
        del loop, runner
        new = regroup.rejoin(store, round_ + 1, me, timeout_s, wait_s=word_s)
        if new is None:
            return None  # not among the survivors (a rank that hung and came back)
        me, ranks, round_ = new, list(range(len(keep))), round_ + 1
        layout = layout.shrunk(len(lost))
        spec = dataclasses.replace(spec, layout=str(layout)).with_engine(fault_injection=None)
        slots = _kept_slots(kept, layout, spec)
        load = None
        if slots is not None:  # the stage rebuilt with the kept slots, filled from the old one
            spec = spec.with_engine(enable_eplb=True, num_redundant_experts=slots - old.config.num_experts)
            load = lambda model, ckpt: carry(old, model, kept, old_rank, me, ckpt)  # noqa: E731
        ctx = ParallelContext.create(layout, me, device, node=node) if layout.world_size > 1 \
            else ParallelContext.single(device)
        runner = ModelRunner(spec, ctx, load=load)
        del old
        todo = [dataclasses.replace(r, generated=list(r.generated) + tokens.get(r.index, []), arrival_step=0)
                for r in requests if r.index not in results]
        layouts.append(str(layout))
        recoveries.append({"lost": lost, "cause": cause, "noticed_s": noticed,
                           "rebuilt_s": time.monotonic() - failed_at,
                           "stalled_s": failed_at - record.last,  # rank 0: its last report to its failure
                           "from_checkpoint": sum(len(s.loads) for s in kept.values()),
                           "from_checkpoint_here": sum(1 for s in kept.values() for x in s.loads if x.rank == me),
                           "carried": load is not None,  # the kept weights, not the checkpoint's
                           "read": sum(runner.checkpoint.tensors_read.values()),  # elements the rebuild read
                           "resumed": {r.index: len(r.generated) for r in todo}})  # request -> tokens it had
    if me != 0:
        return None
    return {"results": [results[r.index] for r in requests], "layouts": layouts, "recoveries": recoveries}


def _elastic_store(rank: int):
    """The store rank 0 serves for the rounds after a loss, its port told over the world group
    (every rank is alive as the run starts)."""
    store = regroup.serve_store() if rank == 0 else None
    box = [store.port if store is not None else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return store if store is not None else regroup.connect("127.0.0.1", box[0], 60.0)


def _kept_slots(kept: dict, layout: Layout, spec: RunSpec) -> int | None:
    """The slots of every MoE layer's kept placement when a stage built with them (E + R
    slots, split as the Dispatcher splits them) can take the old stage's weights: one count and
    split for every layer, plain weights. None: the stage reads the checkpoint again."""
    if not kept or spec.engine.quantization is not None:
        return None
    shapes = {(s.placement.num_slots, s.placement.split) for s in kept.values()}
    if len(shapes) != 1:
        return None
    ((slots, split),) = shapes
    return slots if tuple(expert_split(slots, layout.ep)) == tuple(split) else None
