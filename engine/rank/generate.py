"""run_requests: a fixed list of requests through a rank's EngineCore (engine/rank/core.py) until
every one is done. Every rank of a replica runs it in lock step."""

from __future__ import annotations

from collections import deque

from atoll.engine.rank.core import EngineCore
from atoll.engine.batch.request import Request, finish_reason  # noqa: F401  (this module's API since before core.py)


def run_requests(runner, requests: list[Request], progress=None, *, pipelined: bool = True,
                 on_finish=None, on_token=None, inbox=None) -> list[dict]:
    """Drive `runner.tick` until every request is done; one result per request, in order.
    `progress(done, tokens)` is called after each tick when given, and `on_finish(index,
    result)` as each request finishes (so a caller can write it at once). Under PP,
    `pipelined` keeps a micro-batch in every stage (see engine.batch.lanes); False sends one at a time.
    Requests join at their arrival_step. Disaggregation (engine.disagg.oneshot): `on_token` and
    `inbox` as EngineCore takes them; with an inbox the return is a dict, request index ->
    result, of `requests` and the inbox's."""
    core = EngineCore(runner, pipelined=pipelined, stop_strings=any(r.params.stop for r in requests),
                      on_finish=on_finish, on_token=on_token, inbox=inbox)
    arrivals = deque(sorted(requests, key=lambda r: (r.arrival_step, r.index)))
    runner.start_run()
    while True:
        while arrivals and arrivals[0].arrival_step <= core.tick:
            core.add(arrivals.popleft())
        if not core.step(more=bool(arrivals)):
            break
        core.drain()
        if progress is not None:
            progress(len(core.results), core.produced)
    runner.end_run()
    # every block is back once every request ended; named ones stay cached (evictable)
    runner.stats |= {"blocks_held": core.blocks_in_use(), "blocks_cached": core.cached_blocks()}
    if inbox is not None:
        return core.results  # index -> result
    return [core.results[r.index] for r in requests]
