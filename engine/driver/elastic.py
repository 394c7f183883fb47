"""ElasticEngine: the driver's side of a living engine under --elastic-ep (a DPnEPn engine with
redundant experts, under the local or the Ray launcher). A rank that dies, rank 0 included, does
not end the engine: the driver gives it up (the launcher stops watching it, Ray's actor is
killed), its peers regroup without it and serve on at DP(n-1)EP(n-1)
(engine/rank/elastic_serve.py), and every request that had not ended goes on from the tokens its
sink already got. `degraded` names the lost ranks (the server's /health), the
engine stays healthy; `recoveries` holds one record per loss, `layout` the layout serving now.

The driver serves the elastic store (comm/regroup.py: it outlives every rank) and names the
survivors from a thread of its own: once a rank of the serving round says a collective failed,
it waits for the others' word (regroup.elect) and announces the next round. Each rank has its
own channel pair; the driver talks to the round's rank 0 over its pair. It keeps every request
and the tokens streamed for it, and resumes the unfinished ones on the new leader.

What still ends it: the loss of every rank but one, a rank's own error, and an expert left
without a source (every copy on the lost rank and the checkpoint cannot give it): every request
then ends with that one line.
"""

from __future__ import annotations

import dataclasses
import sys
import threading
import time

from atoll.comm import regroup
from atoll.engine.driver.online import OnlineEngine
from atoll.engine.rank.job import EngineJob
from atoll.engine.worker import worker
from atoll.errors import InputError, LayoutError, RankFailure
from atoll.parallel.layout import Layout


def check_elastic(layout: Layout, options=None, *, disaggregated: bool = False, launcher=None) -> None:
    """InputError, in one line, unless --elastic-ep can run: a DPnEPn layout (n >= 2) with
    redundant expert slots (options: the EngineConfig), one colocated engine, a launcher whose
    jobs go on without a given-up rank (local, Ray; None: not known yet)."""
    if options is not None and (not options.enable_eplb or options.num_redundant_experts < 1):
        raise InputError("--elastic-ep needs --enable-eplb and --num-redundant-experts R >= 1 (spare slots that "
                         "take a lost rank's experts while the survivors keep their weights)")
    if disaggregated:
        raise InputError("--elastic-ep runs one colocated DPnEPn engine, not --prefill/--decode")
    try:
        layout.shrunk(1)
    except LayoutError:
        raise InputError(f"--elastic-ep: layout {layout} cannot go on without a rank; it needs DP-attention/EP, "
                         "DPnEPn with n >= 2 (e.g. --layout DP3EP3)") from None
    if launcher is not None and not getattr(launcher, "elastic", False):
        raise InputError(f"--elastic-ep runs under the local or the Ray launcher, not {type(launcher).__name__} "
                         "(a torchrun/mpirun job's world is fixed: it ends with a rank)")


class ElasticEngine(OnlineEngine):
    def __init__(self, spec, **kwargs):
        self.layout = Layout.parse(spec.layout)
        self.lost: dict[int, str] = {}  # job rank -> the cause of its loss
        self._ranks = list(range(self.layout.world_size))  # the job rank of each rank of the serving round
        self._survivors = list(self._ranks)  # those of the round the driver announced last
        self.recoveries: list[dict] = []
        self._noticed: float | None = None  # when this driver first heard of the latest loss
        self._waiting: dict | None = None  # the latest recovery, until its first step report
        self._requests: dict = {}  # index -> the Request submitted, while it runs
        self._tokens: dict[int, list[int]] = {}  # index -> the tokens its sink got
        check_elastic(self.layout, launcher=kwargs.get("launcher"))
        # the ranks reach the driver's store at the address the launcher names (under Ray the
        # driver node's address as Ray names it, so ranks on other nodes reach it too)
        self._store_host = getattr(kwargs.get("launcher"), "driver_host", lambda: "127.0.0.1")()
        self._store = regroup.serve_store(self._store_host)
        super().__init__(spec, **kwargs)

    def _start(self, launcher, world_size: int, parallel):
        job = dataclasses.replace(EngineJob.colocated(self.spec, parallel, link_stats=self.link_stats,
                                                      cache_events=self.on_events is not None),
                                  elastic_store=f"{self._store_host}:{self._store.port}")
        self._inboxes = [self._inbox] + [launcher.channel() for _ in range(world_size - 1)]
        self._outboxes = [self._outbox] + [launcher.channel() for _ in range(world_size - 1)]
        return launcher.start(worker, world_size, job, self._inboxes, self._outboxes, device=self.spec.engine.device)

    def _ready(self) -> None:
        threading.Thread(target=self._elect, daemon=True, name="atoll-elastic").start()

    @property
    def degraded(self) -> dict[int, str]:
        """Each lost rank -> a line: why, and the layout the engine serves on at."""
        if self.error is not None:
            return {}
        return {r: f"{cause}; the engine serves on at {self.layout}" for r, cause in self.lost.items()}

    def _take(self, request, sink) -> int:
        """OnlineEngine's, the request and the tokens its sink gets kept until it ends."""
        index = request.index
        self._requests[index], self._tokens[index] = request, []

        def kept(kind, payload):
            if kind == "token":
                self._tokens.get(index, []).append(payload[0])
            else:
                self._requests.pop(index, None)
                self._tokens.pop(index, None)
            sink(kind, payload)
        return super()._take(request, kept)

    def _elect(self) -> None:
        """Name the survivors of each round whose collective failed (the driver outlives them all)."""
        round_, timeout_s = 0, self.spec.engine.collective_timeout_s
        while not self._closing and self.error is None:
            ranks = range(len(self._survivors))
            if len(ranks) > 1 and regroup.failed(self._store, round_, ranks):
                keep = regroup.elect(self._store, round_, ranks, timeout_s + 5)
                with self._lock:  # new requests go to the new leader from now on
                    self._survivors = [self._survivors[r] for r in keep]
                    leader = self._survivors[0]
                    self._inbox, self._outbox = self._inboxes[leader], self._outboxes[leader]
                regroup.announce(self._store, round_ + 1, keep)
                round_ += 1
            time.sleep(0.05)

    def _survive(self, e) -> bool:
        if not isinstance(e, RankFailure) or e.rank in self.lost or not e.died:
            return False
        if len(self.lost) + 2 > self.job.world_size:
            return False
        self.lost[e.rank] = e.cause
        self.job.give_up([e.rank])  # ended if alive (a frozen rank), no longer watched
        self._noticed = self._noticed or time.monotonic()
        print(f"atoll: rank {e.rank} lost ({e.cause}); the others regroup without it", file=sys.stderr, flush=True)
        return True

    def _handle(self, msg) -> None:
        if msg[0] == "elastic_failed":  # an expert without a source: the engine ends with its line
            self._fail(msg[1])
        elif msg[0] == "elastic":
            self._resume(msg[1])

    def _resume(self, rec: dict) -> None:
        """The survivors serve again: every request not ended goes to the new leader with its
        tokens, the fewest on each new replica."""
        self._noticed = self._noticed or time.monotonic()
        gone = [j for j in self._ranks if j not in self._survivors]
        self._ranks = list(self._survivors)
        rec["lost"] = gone  # in job ranks
        left = [j for j in gone if j not in self.lost]  # alive but silent: its peers went on without it
        for j in left:
            self.lost[j] = "left out by its peers: it stopped answering within the collective timeout"
        if left:
            self.job.give_up(left)
        with self._lock:
            dp = rec["replicas"]
            self._load, adds = [0] * dp, []
            for index in sorted(self._sinks):
                req = self._requests.get(index)
                if req is None:
                    continue
                replica = self._load.index(min(self._load))
                self._load[replica] += 1
                self._replica[index] = replica
                # a copy (n > 1) computes its prompt again: the request it forked from may be gone
                adds.append((dataclasses.replace(req, generated=list(req.generated) + self._tokens[index],
                                                 arrival_step=0, fork_of=None), replica))
            self.info = {**self.info, "replicas": dp}
            self.layout = Layout.parse(rec["layout"])
            self._inbox.put(("resume", adds))
        rec["placed"] = {req.index: replica for req, replica in adds}
        self.recoveries.append(rec)
        self._waiting = rec

    def _time_step(self, now: float) -> None:
        """The first step report after a recovery: the driver's own recovery time, printed."""
        super()._time_step(now)
        rec = self._waiting
        if rec is None:
            return
        self._waiting = None
        rec["recovery_s"] = now - self._noticed if self._noticed is not None else None
        self._noticed = None
        stalled = "" if rec["stalled_s"] is None else \
            f"rank 0's collective failed {rec['stalled_s']:.2f} s after its last step, "
        print(f"atoll: serving again at {rec['layout']} without rank(s) {rec['lost']}: {stalled}the survivors "
              f"regrouped {rec['rebuilt_s']:.2f} s after their collective failed, the first step came "
              f"{rec['recovery_s']:.2f} s after the driver heard of the loss; {len(rec['placed'])} requests continue with their tokens, {rec['from_checkpoint']} expert slots read "
              "from the checkpoint", file=sys.stderr, flush=True)
