"""A one-shot DP-attention/EP run that goes on without a lost rank (elastic EP): DP4EP4 loses a
rank and finishes as DP3EP3 (launch/elastic.py starts it and gives the dead rank up).

Every rank runs the one rank loop (engine/rank/loop.py) over the requests. When a collective
fails, the survivors regroup and rebuild their stages at the shrunk layout (engine/rank/shrink.py).
Rank 0 then adds every request that had not ended, with the tokens it had taken so far
(Request.generated, the migration's own field), spread over the new DP replicas, so each goes
on from its last token. The living engine does the same (engine/rank/elastic_serve.py).

Rank 0 is the run's link to the driver and serves the elastic store: its loss ends the run.
"""

from __future__ import annotations

import dataclasses
import time

from atoll.engine.batch.request import Request
from atoll.engine.rank.loop import Batch, ServeLoop
from atoll.engine.rank.run_spec import RunSpec
from atoll.engine.rank.shrink import ElasticRank, first_line


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
    me = ElasticRank(spec, rank, world_size, timeout_s, device, node)
    results: dict[int, dict] = {}
    tokens: dict[int, list[int]] = {}
    todo, layouts, recoveries = list(requests), [str(me.layout)], []
    while True:
        dp = me.layout.dp
        batch = Batch(todo, lambda k: k % dp)
        record = _Record(batch, tokens)
        loop = ServeLoop(me.runner, batch, record)
        try:
            loop.ready()
            loop.run()
            results |= batch.results
            break
        except RuntimeError as e:  # a collective failed: a peer is gone
            failed_at = time.monotonic()
            if len(me.ranks) == 1:
                raise
            cause = first_line(e)
        results |= batch.results
        del loop
        rec = me.shrink(cause, failed_at)
        if rec is None:
            return None  # not among the survivors (a rank that hung and came back)
        todo = [dataclasses.replace(r, generated=list(r.generated) + tokens.get(r.index, []), arrival_step=0)
                for r in requests if r.index not in results]
        layouts.append(rec.pop("layout"))
        recoveries.append(rec | {"stalled_s": failed_at - record.last,  # rank 0: its last report to its failure
                                 "resumed": {r.index: len(r.generated) for r in todo}})  # request -> tokens it had
    if me.me != 0:
        return None
    return {"results": [results[r.index] for r in requests], "layouts": layouts, "recoveries": recoveries}
