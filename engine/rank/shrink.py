"""One rank of an elastic EP engine (DPnEPn with redundant experts): its stage, its place in the
elastic store's rounds, and the step from a round whose collective failed to the next round
without the lost ranks. The one-shot run (engine/rank/elastic_run.py) and the living engine
(engine/rank/elastic_serve.py) both go through it.

    rank = ElasticRank(spec, rank, world_size, timeout_s, device, node)   # round 0: every rank
    ... a collective raises (a peer died: gloo says so at once; a peer hung: the group's timeout)
    rec = rank.shrink(cause, failed_at)   # None: this rank is not among the survivors

`shrink`: each survivor says so in the elastic store (comm/regroup.py) that the driver serves (the
living engine: then the driver names the survivors, so rank 0 may be lost too) or else the
engine's rank 0; it waits for the notices and names the survivors; every survivor checks
that every MoE layer's experts keep a source (comm.elastic.survive_layers: a copy on a survivor,
else the checkpoint; `ExpertLost` names the first without one, before anything changes), tears
its process groups down and joins the next round's at the shrunk layout (Layout.shrunk). It then
builds its stage for the new layout with every MoE layer's kept slots, filled from the stage
before the loss (engine/rank/elastic.py's `carry`: the weights kept, the experts without a copy
read from the checkpoint), when every layer kept one slot count and split; else (layers
rebalanced apart, quantized weights) it reads the checkpoint again.
"""

from __future__ import annotations

import dataclasses
import time

import torch.distributed as dist

from atoll.comm import regroup
from atoll.comm.elastic import survive_layers
from atoll.comm.experts import expert_split
from atoll.engine.rank.elastic import carry, checkpoint_has
from atoll.engine.rank.run_spec import RunSpec
from atoll.engine.rank.runner import ModelRunner
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext


class ElasticRank:
    """This rank's stage (`runner`) and its place: `me` among `ranks` in round `round`."""

    def __init__(self, spec: RunSpec, rank: int, world_size: int, timeout_s: float, device: str = "cpu",
                 node: str | None = None, options=None, ranks_here: int | None = None, store: str | None = None):
        """store: "host:port" of the elastic store the driver serves, and then the driver names
        the survivors (rank 0's loss included); None: rank 0 serves it and names them."""
        self.spec, self.layout = spec, Layout.parse(spec.layout)
        self.timeout_s, self.device, self.node = timeout_s, device, node
        # rank 0 names the survivors once all but one noticed, or after timeout_s: a survivor still
        # blocked in a collective notices only at its group's timeout (at most timeout_s after a round
        # starts; the first round's is the collective timeout, ATOLL_COLLECTIVE_TIMEOUT_S)
        self.word_s = 2 * timeout_s + 10
        self.driver_elects = store is not None
        if store is None:
            self.store = elastic_store(rank)
        else:
            host, port = store.rsplit(":", 1)
            self.store = regroup.connect(host, int(port), 60.0)
        self.keep: list[int] = []  # the survivors of the last loss, in the failed round's ranks
        self.me, self.ranks, self.round = rank, list(range(world_size)), 0
        ctx = ParallelContext.create(self.layout, rank, device, options, node=node)
        self.runner = ModelRunner(spec, ctx, ranks_here=ranks_here)

    def shrink(self, cause: str, failed_at: float) -> dict | None:
        """From the failed round to the next without the lost ranks (see the module); the
        recovery's record, or None when this rank is not among the survivors (one that hung and
        came back). Raises ExpertLost, naming the expert, when one has no source left."""
        store, round_ = self.store, self.round
        regroup.notice(store, round_, self.me)
        self.runner.ctx.release()  # its groups' last references: leave() closes their connections
        regroup.leave()  # the peers still in a collective with this rank fail at once, and notice
        if self.me == 0 and not self.driver_elects:
            # past the collective timeout: a survivor blocked in a collective notices only then
            keep = regroup.elect(store, round_, self.ranks, self.timeout_s + 5)
            regroup.announce(store, round_ + 1, keep)
        else:
            keep = regroup.survivors(store, round_ + 1, self.word_s)
        self.keep = keep
        lost = [r for r in range(len(self.ranks)) if r not in keep]
        model = self.runner.model
        placements = {lid: m.placement for lid, m in zip(model.moe_layer_ids, model.moe_layers)}
        kept = survive_layers(placements, lost, checkpoint_has(model, self.runner.checkpoint)) if placements else {}
        noticed = time.monotonic() - failed_at
        old, old_rank = model, self.me
        self.runner = model = None
        new = regroup.rejoin(store, round_ + 1, old_rank, self.timeout_s, wait_s=self.word_s)
        if new is None:
            return None
        me = self.me = new
        self.ranks, self.round = list(range(len(keep))), round_ + 1
        layout = self.layout = self.layout.shrunk(len(lost))
        spec = dataclasses.replace(self.spec, layout=str(layout)).with_engine(fault_injection=None)
        slots = kept_slots(kept, layout, spec)
        load = None
        if slots is not None:  # the stage rebuilt with the kept slots, filled from the old one
            spec = spec.with_engine(enable_eplb=True, num_redundant_experts=slots - old.config.num_experts)
            load = lambda model, ckpt: carry(old, model, kept, old_rank, me, ckpt)  # noqa: E731
        self.spec = spec
        ctx = ParallelContext.create(layout, me, self.device, node=self.node) if layout.world_size > 1 \
            else ParallelContext.single(self.device)
        self.runner = ModelRunner(spec, ctx, load=load)
        return {"lost": lost, "cause": cause, "noticed_s": noticed, "rebuilt_s": time.monotonic() - failed_at,
                "layout": str(layout),
                "from_checkpoint": sum(len(s.loads) for s in kept.values()),
                "from_checkpoint_here": sum(1 for s in kept.values() for x in s.loads if x.rank == me),
                "carried": load is not None,  # the kept weights, not the checkpoint's
                "read": sum(self.runner.checkpoint.tensors_read.values())}  # elements the rebuild read


def first_line(e: BaseException) -> str:
    return str(e).splitlines()[0] if str(e) else type(e).__name__


def elastic_store(rank: int):
    """The store rank 0 serves for the rounds after a loss, its port told over the world group
    (every rank is alive as the engine starts)."""
    store = regroup.serve_store() if rank == 0 else None
    box = [store.port if store is not None else None]
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.broadcast_object_list(box, src=0)
    return store if store is not None else regroup.connect("127.0.0.1", box[0], 60.0)


def kept_slots(kept: dict, layout: Layout, spec: RunSpec) -> int | None:
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
