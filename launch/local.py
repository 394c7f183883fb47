"""Spawn one process per rank on this machine (gloo on 127.0.0.1) and collect results.

The driver watches every rank: the first rank that raises, dies or stops beating ends the
whole job within seconds, and the error names the rank and the cause. Nothing waits for a
collective timeout: each rank's heartbeat thread stamps a shared clock every second, so a
rank frozen by SIGSTOP (or anything that stops the whole process) is named after
STALL_S. The same thread ends the rank when its parent is gone, whatever killed it, so no
rank outlives the job as an orphan. Collectives time out after COLLECTIVE_TIMEOUT_S
(the config's collective_timeout_s, env ATOLL_COLLECTIVE_TIMEOUT_S, default 120 s, well
under gloo's 10 minutes).
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import multiprocessing.reduction as reduction
import os
import pickle
import queue
import signal
import socket
import threading
import sys
import time
import traceback
import types
from contextlib import contextmanager

from atoll import config
from atoll.errors import AtollError, LaunchError, RankFailure
from atoll.launch.device import DeviceError, agree, bind, check_requested, decide, visible_gpus
from atoll.launch.net import pin_interface, rendezvous
from atoll.launch.rank import call_rank

_POLL_S = 0.1
_BEAT_S = 0.5
STALL_S = 10.0  # no heartbeat for this long: the rank is stopped
START_S = 120.0  # a rank that never beat within this long after spawning did not start
_HOST = socket.gethostname()  # every local rank runs on this node
# Ranks fork from multiprocessing's fork server, a clean process (no threads, no CUDA) that
# imports these once: a rank then starts in a fraction of a second instead of importing torch
# again (~1.4 s of every rank's start on 2 cores). Each rank takes the driver's environment,
# stdout and stderr as they are when it starts (_entry), as a spawned process would.
RANK_PRELOAD = ["torch", "torch.distributed", "atoll.engine.worker"]
_SPAWN = multiprocessing.get_context("forkserver")
_SPAWN.set_forkserver_preload(RANK_PRELOAD)
_STARTING = threading.Lock()


@contextmanager
def _own_entry():
    """While ranks are spawned, multiprocessing sees a bare __main__, so a rank starts from
    atoll's own entry (`_entry`) and never imports the user's script again: a script without
    an `if __name__ == "__main__":` guard, a script read from stdin and a notebook all work,
    as under torchrun. (spawn re-runs the parent's __main__ in each child when that module has
    a file or a module name; the stub has neither.)"""
    with _STARTING:
        main = sys.modules.get("__main__")
        stub = types.ModuleType("__main__")
        stub.__spec__ = None
        sys.modules["__main__"] = stub
        try:
            yield
        finally:
            if main is not None:
                sys.modules["__main__"] = main


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def collective_timeout_s() -> float:
    return config.resolve().collective_timeout_s


def init_distributed(rank: int, world_size: int, addr: str, port: int, *, device: str = "cpu",
                     timeout_s: float | None = None) -> str:
    """Bind `device` and join the process group (its backend follows the device); rank 0
    serves the rendezvous store on addr:port only. Returns the device."""
    pin_interface(addr)  # gloo's own sockets on the same interface (lo for 127.0.0.1)
    listen = None
    if rank == 0:
        listen = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listen.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listen.bind((addr, port))
        listen.listen(1024)
    return rendezvous(rank, world_size, addr, port, device=device, requested=device, listen=listen,
                      timeout_s=timeout_s or collective_timeout_s())


def _describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited with code {code}"


def _heartbeat(beats, rank: int) -> None:
    """Stamp beats[rank] every _BEAT_S; leave at once when the driver is gone."""
    driver = multiprocessing.parent_process()  # the driver (the fork server only forks)
    while True:
        if driver is not None and not driver.is_alive():  # the driver died (SIGKILL included)
            os._exit(1)
        beats[rank] = time.monotonic()
        time.sleep(_BEAT_S)


class _Fd:
    """A file descriptor of the driver, handed to a rank as it starts (multiprocessing sends it)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        return _take_fd, (reduction.DupFd(self.fd),)


def _take_fd(dup) -> int:
    return dup.detach()


def _adopt(env: dict, out: int, err: int) -> None:
    """This rank's environment, stdout and stderr: the driver's as it started the rank (the
    fork server holds those of its own start)."""
    os.environ.clear()
    os.environ.update(env)
    sys.stdout.flush()
    sys.stderr.flush()
    for fd, target in ((out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)


def _entry(fn, rank, world_size, port, results, threads, device, beats, std, args, kwargs):
    _adopt(*std)
    threading.Thread(target=_heartbeat, args=(beats, rank), daemon=True, name="atoll-heartbeat").start()
    import torch  # preloaded by the fork server; launch/ itself is torch-free

    torch.set_num_threads(threads)
    try:
        if world_size > 1:
            init_distributed(rank, world_size, "127.0.0.1", port, device=device)
        else:
            bind(device)
        value = call_rank(fn, rank, world_size, args, kwargs)
        # plain pickle copies tensors by value; the queue's own pickler would share them
        # through file descriptors that vanish when this process exits
        results.put(("ok", rank, pickle.dumps(value)))
    except BaseException as e:  # report every failure to the driver, then leave
        line = str(e) if isinstance(e, AtollError) else f"{type(e).__name__}: {e}"
        results.put(("error", rank, line, traceback.format_exc()))
        _flush([results, *_channels(args, kwargs)])
        os._exit(1)
    _flush([results, *_channels(args, kwargs)])
    os._exit(0)  # skip process-group teardown, which can block if a peer already left


def _channels(args, kwargs) -> list:
    """The channels (launcher.channel() queues) among fn's arguments, also inside a list."""
    found = []
    for a in (*args, *kwargs.values()):
        for q in (a if isinstance(a, (list, tuple)) else [a]):
            if isinstance(q, multiprocessing.queues.Queue):
                found.append(q)
    return found


def _flush(queues) -> None:
    """What this rank put on each queue reaches its pipe before the process leaves: a queue's
    feeder thread sends in the background, and os._exit would drop what it still holds (a
    rank 0's last "stopped" or link totals)."""
    for q in queues:
        try:
            q.close()
            q.join_thread()
        except (OSError, ValueError, AssertionError):
            pass


def local_devices(requested: str, world_size: int, gpus: int | None = None, first_gpu: int = 0) -> list[str]:
    """Each local rank's device: rank r on cuda:<first_gpu + r> when this machine shows a GPU
    per rank (first_gpu: where this job's GPUs start, for engine replicas side by side).
    More ranks than GPUs is an error unless the device is cpu (auto with no GPU is cpu)."""
    check_requested(requested)
    if requested == "cpu":
        return ["cpu"] * world_size
    gpus = visible_gpus() if gpus is None else gpus
    need = first_gpu + world_size
    if 0 < gpus < need:
        raise DeviceError(f"{need} ranks need {need} GPUs but this machine shows {gpus}: "
                          f"use a layout of at most {gpus} ranks, more nodes, or --device cpu")
    return agree([decide(requested, r, gpus=gpus, index=first_gpu + r) for r in range(world_size)], requested)


def run_local(fn, world_size: int, *args, timeout_s: float | None = None,
              threads: int | None = None, device: str = "cpu", **kwargs) -> list:
    """Run fn(rank, world_size, *args, **kwargs) in world_size processes; return their values.

    device: "cpu", "cuda" or "auto" (launch.device); each rank binds its device before its
    process group exists. fn must be importable (module level). Raises RankFailure naming the
    first rank that raised or died, after ending every other rank.
    """
    job = LocalJob(fn, world_size, *args, threads=threads, device=device, **kwargs)
    try:
        return job.wait(timeout_s)
    finally:
        job.stop()


def channel():
    """A queue a local rank and the driver can share: give it to LocalJob among fn's arguments."""
    return _SPAWN.Queue()


class LocalJob:
    """world_size spawned processes running fn(rank, world_size, *args, **kwargs), started at
    once. `check()` raises RankFailure for the first rank that raised, died or stopped beating
    (without waiting); `wait()` collects every rank's value; `stop()` ends them all."""

    def __init__(self, fn, world_size: int, *args, threads: int | None = None, device: str = "cpu",
                 first_gpu: int = 0, **kwargs):
        self.devices = devices = local_devices(device, world_size, first_gpu=first_gpu)  # rank -> its device
        self.world_size = world_size
        self._results = _SPAWN.Queue()
        port = free_port()
        if threads is None:
            threads = max(1, (os.cpu_count() or 1) // world_size)
        self._beats = _SPAWN.Array("d", world_size, lock=False)  # each rank's last heartbeat (time.monotonic)
        self.procs = [_SPAWN.Process(target=_entry, daemon=True,
                                     args=(fn, r, world_size, port, self._results, threads, devices[r], self._beats,
                                           (dict(os.environ), _Fd(1), _Fd(2)), args, kwargs))
                      for r in range(world_size)]
        with _own_entry():
            for p in self.procs:
                p.start()
        self._spawned = time.monotonic()
        self.values: dict[int, object] = {}
        self._exited_at: dict[int, float] = {}
        self.lost: set[int] = set()  # ranks given up on (give_up): no longer checked or waited for
        self.stall_s = STALL_S  # a heartbeat this late: the rank is stopped (EngineConfig.heartbeat_timeout_s)

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def check(self, wait_s: float = 0.0) -> None:
        """Take what the ranks reported (waiting up to wait_s for it) and raise RankFailure for
        the first rank that raised, died, left without a result or stopped beating."""
        procs, values = self.procs, self.values
        try:
            msg = self._results.get(timeout=wait_s) if wait_s > 0 else self._results.get_nowait()
        except queue.Empty:
            msg = None
        if msg is not None:
            if msg[1] in self.lost:
                return
            if msg[0] == "error":
                _raise_dead(procs, exclude=msg[1], lost=self.lost)  # a killed peer is the cause, not the symptom
                raise RankFailure(msg[1], msg[2], node=_HOST) from _RemoteTraceback(msg[3])
            values[msg[1]] = pickle.loads(msg[2])
            return
        now = time.monotonic()
        for rank, p in enumerate(procs):
            if rank in values or rank in self.lost or p.exitcode is None:
                continue
            if p.exitcode != 0:
                if p.exitcode > 0:  # it may have reported its own error; a signal sends none
                    _raise_reported(self._results, self.lost)
                raise RankFailure(rank, _describe_exit(p.exitcode), node=_HOST, died=True)
            # exited cleanly: its result may still be in the pipe; allow a moment
            if now - self._exited_at.setdefault(rank, now) > 5.0:
                raise RankFailure(rank, "exited without a result", node=_HOST)
        _check_heartbeats(procs, self._beats, values, now, self._spawned, self.lost, self.stall_s)

    def wait(self, timeout_s: float | None = None) -> list:
        """Every rank's value, in rank order (None for a rank given up on)."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while any(r not in self.values and r not in self.lost for r in range(self.world_size)):
            self.check(wait_s=_POLL_S)
            if deadline is not None and time.monotonic() > deadline:
                missing = [r for r in range(self.world_size) if r not in self.values and r not in self.lost]
                raise LaunchError(f"timed out after {timeout_s:.0f}s waiting for ranks {missing}")
        return [self.values.get(r) for r in range(self.world_size)]

    def give_up(self, ranks) -> None:
        """End these ranks (the rest of the job goes on without them: a disaggregated job's dead
        engine) and stop checking or waiting for them."""
        ranks = [r for r in ranks if r not in self.lost]
        self.lost.update(ranks)
        _stop([self.procs[r] for r in ranks])

    def stop(self) -> None:
        _stop(self.procs)


def _check_heartbeats(procs, beats, values, now: float, spawned: float, lost=(), stall_s: float = STALL_S) -> None:
    """A live rank whose heartbeat stopped (SIGSTOP, a frozen process) is the cause: the others
    only wait for it in a collective."""
    for rank, p in enumerate(procs):
        if rank in values or rank in lost or p.exitcode is not None:
            continue
        last = beats[rank]
        if last == 0.0 and now - spawned > START_S:
            raise RankFailure(rank, f"did not start within {START_S:.0f} s", node=_HOST)
        if last and now - last > stall_s:
            raise RankFailure(rank, f"stopped responding: no heartbeat for {now - last:.0f} s (the process "
                                    f"is stopped, e.g. by SIGSTOP, or frozen)", node=_HOST, died=True)


def _raise_dead(procs, exclude: int, grace_s: float = 2.0, lost=()) -> None:
    """When a rank reports an error, wait briefly for a peer that died without a word (its
    neighbours' errors, such as a reset connection, follow from that death)."""
    end = time.monotonic() + grace_s
    while True:
        for rank, p in enumerate(procs):
            if rank != exclude and rank not in lost and p.exitcode is not None and p.exitcode < 0:
                raise RankFailure(rank, _describe_exit(p.exitcode), node=_HOST, died=True)
        if time.monotonic() > end:
            return
        time.sleep(_POLL_S)


def _raise_reported(results, lost=()) -> None:
    try:
        while True:
            msg = results.get(timeout=0.5)
            if msg[0] == "error" and msg[1] not in lost:
                raise RankFailure(msg[1], msg[2], node=_HOST) from _RemoteTraceback(msg[3])
    except queue.Empty:
        return


def _stop(procs) -> None:
    for p in procs:
        if p.is_alive():
            p.terminate()
            try:
                os.kill(p.pid, signal.SIGCONT)  # a stopped rank handles SIGTERM only once continued
            except OSError:
                pass
    end = time.monotonic() + 3.0
    for p in procs:
        p.join(timeout=max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join(timeout=1.0)


class _RemoteTraceback(Exception):
    """The failing rank's traceback, chained under RankFailure for debugging."""

    def __str__(self):
        return "\n" + self.args[0]
