"""ElasticEngine: the driver's side of a living engine under --elastic-ep (a DPnEPn engine with
redundant experts, local launcher). A rank but rank 0 that dies does not end the engine: the
driver gives it up (the launcher stops watching it), its peers regroup without it and serve on at
DP(n-1)EP(n-1) (engine/rank/elastic_serve.py), and every request that had not ended goes on from
the tokens its sink already got. `degraded` names the lost ranks (the server's /health), the
engine stays healthy; `recoveries` holds one record per loss, `layout` the layout serving now.

What still ends it: rank 0's loss (it serves the elastic store and talks to the driver), the loss
of every rank but one, a rank's own error, and an expert left without a source (every copy on
the lost rank and the checkpoint cannot give it): every request then ends with that one line.
"""

from __future__ import annotations

import sys
import time

from atoll.engine.driver.online import OnlineEngine
from atoll.errors import InputError, LayoutError, RankFailure
from atoll.parallel.layout import Layout


def died(cause: str) -> bool:
    """Whether a RankFailure's cause is the rank's process ending or freezing, not its own error."""
    return cause.startswith(("killed by", "stopped responding", "exited with code"))


def check_elastic(layout: Layout, options=None, *, disaggregated: bool = False, launcher=None) -> None:
    """InputError, in one line, unless --elastic-ep can run: a DPnEPn layout (n >= 2) with
    redundant expert slots (options: the EngineConfig), one colocated engine, the local launcher
    (None: not known yet)."""
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
        raise InputError(f"--elastic-ep runs under the local launcher, not {type(launcher).__name__}")


class ElasticEngine(OnlineEngine):
    def __init__(self, spec, **kwargs):
        self.layout = Layout.parse(spec.layout)
        self.lost: dict[int, str] = {}  # job rank -> the cause of its loss
        self._ranks = list(range(self.layout.world_size))  # the job rank of each rank of the serving round
        self.recoveries: list[dict] = []
        self._noticed: float | None = None  # when this driver first heard of the latest loss
        self._waiting: dict | None = None  # the latest recovery, until its first step report
        check_elastic(self.layout, launcher=kwargs.get("launcher"))
        super().__init__(spec, **kwargs)

    @property
    def degraded(self) -> dict[int, str]:
        """Each lost rank -> a line: why, and the layout the engine serves on at."""
        if self.error is not None:
            return {}
        return {r: f"{cause}; the engine serves on at {self.layout}" for r, cause in self.lost.items()}

    def _survive(self, e) -> bool:
        if not isinstance(e, RankFailure) or e.rank == 0 or e.rank in self.lost or not died(e.cause):
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
            rec = msg[1]
            self._noticed = self._noticed or time.monotonic()
            gone = [self._ranks[r] for r in rec["lost"]]
            self._ranks = [j for j in self._ranks if j not in gone]
            rec["lost"] = gone  # in job ranks
            left = [j for j in gone if j not in self.lost]  # alive but silent: its peers went on without it
            for j in left:
                self.lost[j] = "left out by its peers: it stopped answering within the collective timeout"
            if left:
                self.job.give_up(left)
            with self._lock:
                dp = rec["replicas"]
                for index, replica in self._replica.items():
                    self._replica[index] = rec["placed"].get(index, replica % dp)
                self._load = [0] * dp
                for replica in self._replica.values():
                    self._load[replica] += 1
                self.info = {**self.info, "replicas": dp}
                self.layout = Layout.parse(rec["layout"])
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
        print(f"atoll: serving again at {rec['layout']} without rank(s) {rec['lost']}: rank 0's collective failed "
              f"{rec['stalled_s']:.2f} s after its last step, the survivors regrouped {rec['rebuilt_s']:.2f} s after "
              f"that, the first step came {rec['recovery_s']:.2f} s after the driver heard of the loss; "
              f"{len(rec['placed'])} requests continue with their tokens, {rec['from_checkpoint']} expert slots read "
              "from the checkpoint", file=sys.stderr, flush=True)
