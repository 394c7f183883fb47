"""One MoE layer's weights moved to a new expert placement while the engine serves.

    move = LayerMove(moe, new, group)   # between two steps: the copies start
    ...                                 # a step runs on the old placement meanwhile
    move.finish()                       # between the next two: wait, write, switch

comm.eplb.moves lists the slots whose expert changes and where each one's weights come from.
`LayerMove` starts them at once: a slot filled from this rank's own weights is copied into a
staging tensor, a slot filled from a peer is received into one (torch.distributed irecv,
matched by the peer's isend of the weights it holds; both sides walk the same list in the
same order, so each pair's messages pair up), over a process group of its own, so that the
copies run beside the step's collectives without sharing their queue (gloo's threads on the
CPU; on NCCL the group's own stream). Nothing the step reads is written until `finish`,
which waits for every copy, writes the staging tensors into the weights in place (a captured
CUDA graph reads the same storage) and switches the routing (ExpertMap.set): every rank of the
ep group finishes the same layer between the same two steps, so they all route by one
placement in every step.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from atoll.comm.eplb import Placement, moves


class LayerMove:
    def __init__(self, moe, new: Placement, group):
        """moe: a SparseMoE; new: its next placement (the same slots); group: the ep group's
        own process group for the copies (None: a one-rank ep group, whose moves are all local)."""
        self.moe, self.new = moe, new
        ep = moe.ctx.ep
        me, ranks = ep.rank, ep.ranks
        self.tensors = moe.experts.slot_tensors()  # each [local slots, ...]
        self.staged: dict[int, list[torch.Tensor]] = {}  # local slot -> its new rows, one per tensor
        self.works, self.sending = [], []
        self.received = 0  # bytes received from peers
        for mv in moves(moe.placement, new, moe.dispatcher.island_of):
            if mv.dst == me and mv.src == me:
                self.staged[mv.dst_slot] = [t[mv.src_slot].clone() for t in self.tensors]
            elif mv.dst == me:
                bufs = [torch.empty_like(t[0]) for t in self.tensors]
                self.works += [dist.irecv(b, src=ranks[mv.src], group=group) for b in bufs]
                self.staged[mv.dst_slot] = bufs
                self.received += sum(b.numel() * b.element_size() for b in bufs)
            elif mv.src == me:
                rows = [t[mv.src_slot] for t in self.tensors]  # contiguous views, unchanged until finish
                self.sending += rows
                self.works += [dist.isend(r, dst=ranks[mv.dst], group=group) for r in rows]

    def wait(self) -> None:
        """Wait for the copies to and from the peers."""
        for w in self.works:
            w.wait()
        self.works.clear()
        self.sending.clear()

    @torch.no_grad()
    def finish(self) -> None:
        """Wait for the copies, write them into the weights and route by the new placement."""
        self.wait()
        for slot, rows in self.staged.items():
            for t, r in zip(self.tensors, rows):
                t[slot].copy_(r)
        moe, me = self.moe, self.moe.ctx.ep.rank
        moe.placement = self.new
        moe.experts.logical = self.new.local(me)
        if moe.expert_map is not None:
            moe.expert_map.set(self.new)
        self.staged.clear()
