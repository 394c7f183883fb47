"""ExpertBalancer: one rank's window of expert loads, the load it reports, and with
--enable-eplb the rebalances that move experts between its ep group's ranks while serving.

Window. During a step each MoE layer of the stage adds its routed pairs into its row of the
model's [moe layers, slots] counter (models/moe.py, layers/expert_map.py: on the device, no
host read). After every step that ran, the rank loop calls `after_step`: every `chunk` steps
the counter goes into a ring of chunks on the device and is zeroed (two device copies; no
host read), so the window is the last --eplb-window-size steps in chunks of ceil(window / 32)
steps (32 chunks hold the window in a 32nd of a per-step ring's memory: DeepSeek-V3's 58
layers x 288 slots for 1000 steps would be 133 MB a rank), plus the chunk under way.

Report (`measure`, every --expert-load-interval steps and at the end of a run). The window is
summed, all_reduced over the ep group (each routing decision is counted on one rank of it:
layers/moe.py), read to the host once, and each layer's tokens per ep rank (the sum over its
slots) and max/mean go to the engine's rank 0 (gathered over the stages under PP). A layer
rebalanced restarts its window at its switch: counts by the old slots say nothing of the new.

Rebalance (every --eplb-step-interval steps with --enable-eplb). Each layer's logical loads
over the window (the sum over each expert's copies) are queued; one layer a step boundary is
placed (comm.eplb.rebalance: every rank of the ep group computes the same placement from the
same sums, so nothing is broadcast) and, when its placement changed, moved
(engine/rank/expert_moves.py): its copies start at that boundary and run in the background
during the next step, its switch happens at the following boundary. So a step waits for at
most one layer's placement (~10 ms in Python for 256 experts over 32 ranks; all 58 of
DeepSeek-V3's at once would be half a second) and one layer's copies.
`rebalance(now=True)` moves every layer before returning (a synchronous rearrangement:
--no-eplb-async, which stalls the step after it by every layer's copies).
"""

from __future__ import annotations

from collections import deque

import torch
import torch.distributed as dist

from atoll.comm.eplb import LoadReport, imbalance
from atoll.comm.eplb import rebalance as place
from atoll.engine.rank.expert_moves import LayerMove
from atoll.errors import ConfigError

RING = 32  # chunks the window is kept in


class ExpertBalancer:
    def __init__(self, model, ctx, engine):
        self.model, self.ctx = model, ctx
        self.layers, self.ids = model.moe_layers, model.moe_layer_ids
        self.counts = model.expert_load  # [layers, slots] the step adds into
        self.counts.zero_()  # not the passes before serving (a GPU's memory profile runs a full step)
        window = engine.eplb_window_size
        self.chunk = -(-window // RING)
        self.ring = self.counts.new_zeros(-(-window // self.chunk), *self.counts.shape)
        self.window = window
        self.steps = 0
        self.eplb, self.interval, self.background = engine.enable_eplb, engine.eplb_step_interval, engine.eplb_async
        self.report_every = engine.expert_load_interval
        self.report: dict | None = None  # the last measure, on the engine's rank 0
        self.rebalances, self.layers_moved, self.moved_bytes = 0, 0, 0
        self.queue: deque = deque()  # (layer index, its logical loads) to place and move, in order
        self.moving: LayerMove | None = None
        self.group = self._group() if self.eplb and ctx.ep.size > 1 and self.layers else None

    @classmethod
    def build(cls, runner) -> "ExpertBalancer | None":
        """The runner's balancer, or None for a dense model (--enable-eplb then is an error)."""
        engine = runner.spec.engine
        if not runner.config.is_moe:
            if engine.enable_eplb:
                raise ConfigError(f"--enable-eplb balances MoE experts; {runner.config.model_type} has none")
            return None
        return cls(runner.model, runner.ctx, engine)

    def _group(self):
        """A process group of this rank's ep group for the weight copies, made by its members
        alone (another ep group, or another engine of the job, does not join)."""
        return dist.new_group(list(self.ctx.ep.ranks), use_local_synchronization=True)

    def after_step(self) -> None:
        """Between two steps, on every rank of the engine after each step that ran."""
        self.steps += 1
        if self.steps % self.chunk == 0:
            self.ring[(self.steps // self.chunk - 1) % len(self.ring)].copy_(self.counts)
            self.counts.zero_()
        self._advance()
        if self.report_every and self.steps % self.report_every == 0:
            self.measure()
        if self.eplb and self.steps % self.interval == 0:
            self.rebalance(now=not self.background)

    def _loads(self) -> list[list[int]]:
        """[moe layer][slot] tokens over the window, summed over the ep group (one host read)."""
        loads = self.ring.sum(0) + self.counts
        if loads.numel():
            self.ctx.ep.all_reduce(loads)
        return loads.tolist()

    def measure(self) -> dict | None:
        """Each layer's tokens per ep rank over the window and their max/mean, into `report`
        on the engine's rank 0 (returned there; None elsewhere). Every rank calls it together."""
        loads = self._loads()
        mine = {layer_id: (m.placement.rank_loads(counts), m.placement.logical_loads(counts))
                for layer_id, m, counts in zip(self.ids, self.layers, loads)}
        world = self.ctx.world
        if self.ctx.layout.pp > 1:  # each stage's layers to rank 0
            parts = [None] * world.size if world.rank == 0 else None
            dist.gather_object(mine, parts, dst=world.ranks[0], group=world.pg)
            mine = {k: v for part in (parts or []) for k, v in part.items()}
        moved = torch.tensor([self.moved_bytes], device=self.counts.device)
        world.all_reduce(moved)  # every ep group's copies (one per moe_tp shard) moved bytes
        if world.rank != 0:
            return None
        # tokens per ep rank (the balance) and per logical expert (what `atoll plan --expert-loads` places)
        layers = {k: {"tokens": ranks, "experts": experts, "max_mean": round(imbalance(ranks), 4)}
                  for k, (ranks, experts) in sorted(mine.items())}
        worst = max(layers, key=lambda k: layers[k]["max_mean"], default=None)
        self.report = LoadReport(layers=layers, worst_layer=worst,
                                 max_mean=layers[worst]["max_mean"] if worst is not None else 0.0,
                                 window_steps=min(self.steps, self.window), rebalances=self.rebalances,
                                 layers_moved=self.layers_moved, moved_bytes=int(moved))
        return self.report

    def rebalance(self, *, now: bool = False) -> None:
        """Queue every layer that counted tokens with its logical loads over the window, to be
        placed anew and moved one a step (now: all of them before returning). Every rank calls
        it together."""
        if self.group is None and self.ctx.ep.size > 1 and self.layers:  # asked for without --enable-eplb
            self.group = self._group()
        for i, (m, counts) in enumerate(zip(self.layers, self._loads())):
            if sum(counts):  # else nothing was counted since this layer's last switch
                self.queue = deque((j, x) for j, x in self.queue if j != i)  # an older snapshot of it: dropped
                self.queue.append((i, m.placement.logical_loads(counts)))
        self.rebalances += 1
        self._advance()
        while now and (self.moving is not None or self.queue):
            self._advance()

    def reset(self) -> None:
        """An empty window (a benchmark's rounds each measure their own)."""
        self.ring.zero_()
        self.counts.zero_()
        self.steps = 0

    def close(self) -> None:
        """The end of a run: the copies in flight complete (the peers wait for the same ones),
        and the placement stays the one the window counted by."""
        self.queue.clear()
        if self.moving is not None:
            self.moving.wait()
            self.moving = None

    def _advance(self) -> None:
        """Switch the layer whose copies ran during the last step, then start the next one's."""
        if self.moving is not None:
            move, self.moving = self.moving, None
            move.finish()
            i = self.layers.index(move.moe)
            self.ring[:, i].zero_()  # its window restarts under the new slots
            self.counts[i].zero_()
            self.layers_moved += 1
            self.moved_bytes += move.received
        if self.queue:  # one layer placed a step: DeepSeek-V3's 256 experts over 32 ranks take ~10 ms
            i, loads = self.queue.popleft()
            m = self.layers[i]
            new = place(loads, m.placement.split, groups=m.gate.n_group, islands=m.dispatcher.islands,
                        old=m.placement)
            if new != m.placement:
                self.moving = LayerMove(m, new, self.group)
