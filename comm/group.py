"""Group: one process group with the collectives atoll's layers use.

Every collective in atoll goes through a Group, so each call and byte is counted and a
size-1 group costs nothing. Works over NCCL (GPU) and gloo (CPU); gloo lacks
reduce_scatter, which is then an all_reduce followed by a local slice.

async_op=True (all_reduce, all_gather, reduce_scatter, all_to_all): the collective starts and a
comm.pending.Pending comes back, whose wait() gives what the call would have returned (the
overlapped steps of two-batch overlap). torch runs it on gloo's threads or NCCL's stream.
"""

from __future__ import annotations

import math
from collections import Counter

import torch
import torch.distributed as dist

from atoll.comm.pending import Pending


_OPS = {"sum": dist.ReduceOp.SUM, "min": dist.ReduceOp.MIN, "max": dist.ReduceOp.MAX}


class Group:
    def __init__(self, pg=None, ranks=(0,), rank: int = 0, name: str = "", device="cpu"):
        self.pg = pg
        self.device = torch.device(device)  # where this group's own small tensors live
        self.ranks = tuple(ranks)  # global ranks, in group order
        self.rank = self.ranks.index(rank)  # this process's index inside the group
        self.size = len(self.ranks)
        self.name = name
        self.calls: Counter = Counter()
        self.bytes: Counter = Counter()  # bytes this rank sent, per operation

    @classmethod
    def single(cls, name: str = "", device="cpu") -> "Group":
        return cls(None, (0,), 0, name, device)

    @classmethod
    def from_torch(cls, pg=None, name: str = "") -> "Group":
        """Wrap a process group another engine made (None: the default world group)."""
        pg = pg if pg is not None else dist.group.WORLD
        ranks = dist.get_process_group_ranks(pg)
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(pg) == "nccl" else "cpu"
        return cls(pg, ranks, dist.get_rank(), name, device)

    def __repr__(self):
        return f"Group({self.name or '?'}, rank {self.rank} of {self.ranks})"

    def _count(self, op: str, nbytes: int):
        if torch.compiler.is_compiling():  # inside a compiled step reading a count would guard on it: not counted
            return
        self.calls[op] += 1
        self.bytes[op] += int(nbytes)

    @property
    def _gloo(self) -> bool:
        return dist.get_backend(self.pg) == "gloo"

    def all_reduce(self, x: torch.Tensor, op: str = "sum", *, async_op: bool = False):
        """Sum (or min, max) over the group, in place; returns x."""
        if self.size == 1:
            return Pending.done(x) if async_op else x
        self._count("all_reduce", x.numel() * x.element_size())
        work = dist.all_reduce(x, op=_OPS[op], group=self.pg, async_op=async_op)
        return Pending(work, x) if async_op else x

    def all_gather(self, x: torch.Tensor, dim: int = -1, *, async_op: bool = False):
        """Concatenate every rank's x along dim, in group order."""
        if self.size == 1:
            return Pending.done(x) if async_op else x
        self._count("all_gather", x.numel() * x.element_size())
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.size)]
        work = dist.all_gather(parts, x, group=self.pg, async_op=async_op)
        if async_op:
            return Pending(work, parts, lambda p: torch.cat(p, dim=dim))
        return torch.cat(parts, dim=dim)

    def reduce_scatter(self, x: torch.Tensor, dim: int = 0, *, async_op: bool = False):
        """Sum over the group, then keep this rank's 1/size chunk along dim."""
        if self.size == 1:
            return Pending.done(x) if async_op else x
        if x.shape[dim] % self.size:
            raise ValueError(f"reduce_scatter: dim {dim} of size {x.shape[dim]} not divisible by {self.size}")
        self._count("reduce_scatter", x.numel() * x.element_size())
        if self._gloo:
            summed = x.clone()
            work = dist.all_reduce(summed, group=self.pg, async_op=async_op)
            if async_op:
                return Pending(work, summed, lambda s: s.chunk(self.size, dim=dim)[self.rank].contiguous())
            return summed.chunk(self.size, dim=dim)[self.rank].contiguous()
        x = x.movedim(dim, 0).contiguous()
        out = torch.empty((x.shape[0] // self.size, *x.shape[1:]), dtype=x.dtype, device=x.device)
        work = dist.reduce_scatter_tensor(out, x, group=self.pg, async_op=async_op)
        if async_op:
            return Pending(work, out, lambda o: o.movedim(0, dim))
        return out.movedim(0, dim)

    def all_to_all(self, x: torch.Tensor, send_splits: list[int], recv_splits: list[int], *,
                   async_op: bool = False):
        """Rows x[sum(send_splits[:j]) : ...] go to rank j; returns rows received, in rank order."""
        if self.size == 1:
            return Pending.done(x) if async_op else x
        x = x.contiguous()
        row = math.prod(x.shape[1:]) * x.element_size() if x.dim() > 1 else x.element_size()
        self._count("all_to_all", (sum(send_splits) - send_splits[self.rank]) * row)
        out = x.new_empty((sum(recv_splits), *x.shape[1:]))
        work = dist.all_to_all_single(out, x, output_split_sizes=list(recv_splits),
                                      input_split_sizes=list(send_splits), group=self.pg, async_op=async_op)
        return Pending(work, out, _Keep(x)) if async_op else out

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """x from group rank src to every rank, in place; returns x."""
        if self.size == 1:
            return x
        if self.rank == src:
            self._count("broadcast", x.numel() * x.element_size())
        dist.broadcast(x, src=self.ranks[src], group=self.pg)
        return x

    def send(self, x: torch.Tensor, dst: int) -> None:
        self._count("send", x.numel() * x.element_size())
        dist.send(x.contiguous(), dst=self.ranks[dst], group=self.pg)

    def isend(self, x: torch.Tensor, dst: int):
        """Starts sending x; returns the work to wait() on. x must stay unchanged until then."""
        self._count("send", x.numel() * x.element_size())
        x = x.contiguous()
        return _Sending(dist.isend(x, dst=self.ranks[dst], group=self.pg), x)

    def recv(self, shape, dtype: torch.dtype, src: int, device=None) -> torch.Tensor:
        out = torch.empty(shape, dtype=dtype, device=device or self.device)
        self.calls["recv"] += 1
        dist.recv(out, src=self.ranks[src], group=self.pg)
        return out

    def barrier(self) -> None:
        if self.size > 1:
            dist.barrier(group=self.pg)

    def reset_counters(self) -> None:
        self.calls.clear()
        self.bytes.clear()


class _Keep:
    """Holds an async collective's input until its wait (the buffer must outlive the exchange)."""

    def __init__(self, tensor: torch.Tensor):
        self.tensor = tensor

    def __call__(self, out):
        self.tensor = None
        return out


class _Sending:
    """An isend's work and the tensor it reads, kept alive until wait()."""

    def __init__(self, work, tensor: torch.Tensor):
        self.work, self.tensor = work, tensor

    def wait(self) -> None:
        self.work.wait()
        self.tensor = None
