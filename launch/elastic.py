"""The driver of a one-shot elastic EP run on this machine (engine/rank/elastic_run.py): the
ranks start as one local job; a rank that dies (or stops beating) is given up instead of ending
the job, while the survivors rebuild their groups without it and finish the requests. The loss
of rank 0 (the run's link to the driver and its elastic store) still ends the run.
"""

from __future__ import annotations

import time

from atoll.engine.rank.elastic_run import elastic_worker
from atoll.errors import LaunchError, RankFailure
from atoll.launch.local import LocalJob


def run_elastic(spec, requests, world_size: int, *, timeout_s: float = 10.0, wait_s: float | None = None,
                threads: int | None = None) -> dict:
    """Rank 0's answer ({"results", "layouts", "recoveries", "lost"}). timeout_s: the ranks'
    bound on noticing a hung peer and on each wait of a regroup; wait_s: the whole run's."""
    job = LocalJob(elastic_worker, world_size, spec, requests, timeout_s=timeout_s, threads=threads)
    lost: list[int] = []
    deadline = None if wait_s is None else time.monotonic() + wait_s
    try:
        # rank 0 answers for the run; a rank left out alive (one that went silent) is ended below
        while 0 not in job.values:
            try:
                job.check(wait_s=0.1)
            except RankFailure as e:
                # a survivor's own failure (an expert without a source, say) is the run's
                if e.rank == 0 or e.rank in lost or not e.died or len(lost) + 2 > world_size:
                    raise
                lost.append(e.rank)
                job.give_up([e.rank])
            if deadline is not None and time.monotonic() > deadline:
                raise LaunchError(f"the elastic run did not end within {wait_s:.0f}s")
    finally:
        job.stop()
    return {**job.values[0], "lost": lost}

