"""Process groups rebuilt without lost ranks (elastic EP), over a store that outlives them.

A store served by a rank dies with it, so the groups of an elastic job rendezvous over a
TCPStore served by a process whose loss ends the job anyway: the driver, or the engine's rank 0
(engine/rank/elastic_run.py), the run's only link to its driver. Each round of the job
has its own key prefix (torch's PrefixStore, as vLLM's fault-tolerant EP does), so a rebuilt
group never reads the keys of the one before:

    driver                              every rank
    store = serve_store()               join(store, 0, rank, world, timeout_s)
                                        ... a collective raises: a peer died (gloo: "Connection
                                        closed by peer" at once) or hung (the group's timeout_s)
                                        notice(store, 0, rank); leave()
    (sees the rank's process exit, or a
     notice: ends the silent rank)
    announce(store, 1, survivors)       new = rejoin(store, 1, rank, timeout_s)   # None: not kept

`timeout_s` bounds how long a collective waits for a hung peer (detection time), and how long a
rank waits for the driver's word on the survivors.
"""

from __future__ import annotations

import gc
import time
from datetime import timedelta

import torch.distributed as dist

from atoll.errors import RankFailure

PREFIX = "atoll/elastic"


def serve_store(addr: str = "127.0.0.1", port: int = 0) -> dist.TCPStore:
    """A store the driver serves (port 0: a free one, read back from `store.port`)."""
    return dist.TCPStore(addr, port, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=60))


def connect(addr: str, port: int, timeout_s: float) -> dist.TCPStore:
    """A rank's client of the driver's store."""
    return dist.TCPStore(addr, port, is_master=False, timeout=timedelta(seconds=timeout_s))


def join(store, round_: int, rank: int, world_size: int, timeout_s: float, backend: str = "gloo") -> None:
    """The default process group of round `round_`, its collectives timing out after timeout_s."""
    prefixed = dist.PrefixStore(f"{PREFIX}/{round_}/pg", store)
    dist.init_process_group(backend, store=prefixed, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))


def notice(store, round_: int, rank: int) -> None:
    """A rank's word that a collective of round `round_` failed (the driver may not see a hung
    peer's process end: it ends it, then announces the survivors)."""
    store.set(f"{PREFIX}/{round_}/failed/{rank}", "1")


def leave() -> None:
    """Tear down every process group of this rank at once, after its `notice`: peers still
    blocked in a collective with it then fail at once (their connections close) instead of at
    their timeout, and notice in turn."""
    if dist.is_initialized():
        dist.destroy_process_group()
    gc.collect()  # a group held only in a cycle (a failed collective's traceback) goes now, its sockets closed


def failed(store, round_: int, ranks) -> list[int]:
    """The ranks that said a collective of round `round_` failed."""
    return [r for r in ranks if store.check([f"{PREFIX}/{round_}/failed/{r}"])]


def elect(store, round_: int, ranks, timeout_s: float, grace_s: float = 0.5) -> list[int]:
    """The survivors of round `round_` as its leader (a rank that outlives the others: the one
    serving `store`) sees them: the ranks that noticed the failure. Waits until all but one of
    `ranks` did (then grace_s more for the rest) or timeout_s has passed."""
    ranks = list(ranks)
    deadline = time.monotonic() + timeout_s
    settle = None
    while True:
        seen = failed(store, round_, ranks)
        now = time.monotonic()
        if len(seen) == len(ranks) or now > deadline or (settle is not None and now > settle):
            return seen
        if settle is None and len(seen) >= len(ranks) - 1:
            settle = now + grace_s
        time.sleep(0.01)


def announce(store, round_: int, survivors) -> None:
    """The driver's word: the ranks of the last round (in its numbering) that go on."""
    store.set(f"{PREFIX}/{round_}/survivors", ",".join(str(r) for r in survivors))


def survivors(store, round_: int, timeout_s: float) -> list[int]:
    """Wait (at most timeout_s) for the driver's word on round `round_`."""
    key = f"{PREFIX}/{round_}/survivors"
    deadline = time.monotonic() + timeout_s
    while not store.check([key]):
        if time.monotonic() > deadline:
            raise RankFailure(-1, f"no word on the survivors of elastic round {round_} within {timeout_s:.0f}s")
        time.sleep(0.01)
    return [int(r) for r in store.get(key).decode().split(",") if r]


def rejoin(store, round_: int, rank: int, timeout_s: float, backend: str = "gloo",
           wait_s: float | None = None) -> int | None:
    """Tear down every process group of this rank and join round `round_`'s among the
    survivors (its collectives timing out after timeout_s); returns the rank's new rank (its
    place among them), None when it is not one. wait_s: the wait for the word (default timeout_s)."""
    keep = survivors(store, round_, timeout_s if wait_s is None else wait_s)
    leave()  # every group: the old ones wait on a dead peer
    if rank not in keep:
        return None
    new = keep.index(rank)
    join(store, round_, new, len(keep), timeout_s, backend)
    return new
