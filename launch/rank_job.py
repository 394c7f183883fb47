"""torchrun / mpirun: this process is one rank of a job its launcher started, and rank 0 is
also the driver (the living engine's OnlineEngine and the CLI writing results).

On rank 0, `RankLauncher.start` makes a RankJob: the rendezvous and fn run in a thread of
this process (launch.torchrun.run_torchrun or launch.mpi_launcher.run_mpi, as `launch` runs
them), and the driver talks to fn through plain queue.Queues (`channel`). Every other rank
calls `RankLauncher.join`, which runs the same fn in the calling thread until it returns
(the living engine's ranks: until rank 0 broadcasts stop). Only rank 0 touches the channels;
the others pass None. Every rank runs fn with rank 0's first argument (broadcast once the
process group exists), so a spec rank 0's driver computed (say, a cache sized from this
machine's free memory) is the one every rank builds.

When fn fails on rank 0, check() raises RankFailure naming rank 0, so the driver can end its
requests with that cause before the process exits; torchrun and mpirun then end the other
ranks. A failing rank other than 0 ends the job as its launcher does (mpirun: MPI_Abort).
"""

from __future__ import annotations

import queue
import socket
import threading

from atoll.errors import AtollError, LaunchError, RankFailure
from atoll.launch.launchers import is_first_rank
from atoll.launch.mpi_launcher import run_mpi, start_mpi
from atoll.launch.rank import call_rank
from atoll.launch.torchrun import run_torchrun

IN_JOB = ("torchrun", "mpi")


def with_first_from_rank0(rank: int, world_size: int, fn, first, *args, **kwargs):
    """fn(rank, world_size, first, *args, **kwargs) with rank 0's `first` on every rank."""
    if world_size > 1:
        import torch.distributed as dist

        box = [first]
        dist.broadcast_object_list(box, src=0)
        first = box[0]
    return call_rank(fn, rank, world_size, (first, *args), kwargs)


def channel() -> queue.Queue:
    """A queue between the driver and rank 0's fn: both are this process."""
    return queue.Queue()


class RankJob:
    """fn on this process's rank (rank 0) in a thread: `run(fn, world_size, *args, **kwargs)`
    is run_torchrun or run_mpi. check() raises RankFailure when that thread raised; wait()
    joins it and returns rank 0's value (the other ranks' stay in their processes: None)."""

    def __init__(self, run, fn, world_size: int, *args, **kwargs):
        self.world_size = world_size
        self._value = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._main, args=(run, fn, world_size, args, kwargs),
                                        daemon=True, name="atoll-rank-0")
        self._thread.start()

    def _main(self, run, fn, world_size, args, kwargs) -> None:
        try:
            self._value = run(fn, world_size, *args, **kwargs)[1]
        except BaseException as e:  # noqa: BLE001 - the driver's check() reports it
            self._error = e

    def check(self, wait_s: float = 0.0) -> None:
        if wait_s > 0:
            self._thread.join(wait_s)
        e = self._error
        if e is None:
            return
        if isinstance(e, RankFailure):
            raise e
        line = str(e) if isinstance(e, AtollError) else f"{type(e).__name__}: {e}"
        raise RankFailure(0, line, node=socket.gethostname()) from e

    def wait(self, timeout_s: float | None = None) -> list:
        self._thread.join(timeout_s)
        if self._thread.is_alive():
            raise LaunchError(f"timed out after {timeout_s:.0f}s waiting for rank 0")
        self.check()
        return [self._value] + [None] * (self.world_size - 1)

    def stop(self) -> None:
        """Nothing to end here: the thread returns once fn does (the driver told it to stop); one
        still running is a daemon and ends with this process, and the job's launcher then ends
        the other ranks."""


class RankLauncher:
    """The launcher for a process that torchrun or mpirun started (name: "torchrun" or "mpi").
    placement / strict_placement: a plan's, checked as launch.launchers.launch does. parallel:
    the ranks' ContextOptions (a plan's islands and nodes), in place of the caller's."""

    def __init__(self, name: str, *, placement=None, strict_placement: bool = False, parallel=None):
        if name not in IN_JOB:
            raise ValueError(f"RankLauncher runs under {' or '.join(IN_JOB)}, not {name!r}")
        self.name = name
        self.parallel = parallel
        self._opts = {"placement": placement, "strict_placement": strict_placement}

    @property
    def first(self) -> bool:
        """Whether this process is rank 0 (the driver)."""
        return is_first_rank(self.name)

    def _run(self, fn, world_size: int, *args, abort_on_error: bool = True, timeout_s=None, **kwargs):
        if self.parallel is not None and "parallel" in kwargs:
            kwargs["parallel"] = self.parallel
        if self.name == "torchrun":
            return run_torchrun(fn, world_size, *args, **self._opts, **kwargs)
        extra = {} if timeout_s is None else {"timeout_s": timeout_s}
        return run_mpi(fn, world_size, *args, abort_on_error=abort_on_error, **extra, **self._opts, **kwargs)

    def __call__(self, fn, world_size: int, *args, **kwargs) -> list:
        """One job, run by every rank's process at once: this rank's value (rank 0's on rank 0)."""
        return [self._run(fn, world_size, *args, **kwargs)[1]]

    def start(self, fn, world_size: int, first, *args, **kwargs) -> RankJob:
        """On rank 0: fn(rank 0, world_size, first, *args) in a thread; the other ranks join()."""
        if not self.first:
            raise LaunchError(f"only rank 0 of a {self.name} job starts its ranks; the others join()")
        if self.name == "mpi":
            start_mpi()  # MPI starts in the main thread; rank 0's work then runs in another
        # a failure on rank 0 is reported to the driver (check), not aborted at once
        return RankJob(self._run, with_first_from_rank0, world_size, fn, first, *args,
                       abort_on_error=False, **kwargs)

    def join(self, fn, world_size: int, *args, **kwargs):
        """On every rank but 0: fn(rank, world_size, rank 0's first argument, *args[1:]) here,
        until it returns; its value."""
        first, *rest = args or (None,)
        return self._run(with_first_from_rank0, world_size, fn, first, *rest, **kwargs)[1]

    channel = staticmethod(channel)
