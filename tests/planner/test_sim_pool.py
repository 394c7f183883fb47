"""The search's worker pool: results in the tasks' order whoever finishes first, and a failing
task ends the pool at once with no worker left behind, even in a process whose SIGTERM handler
does not end it (the CLI's raises, a server's drains)."""

import multiprocessing
import signal
import time

import pytest

from atoll.cli.main import _on_sigterm
from atoll.planner.sim.pool import run_tasks


class _Judge:
    def __init__(self):
        self.cache, self.runs, self.progress = {}, 0, None


def _square(k):
    def task(judge):
        time.sleep(0.05 * (3 - k))  # the later tasks finish first
        judge.cache[k] = k * k
        judge.runs += 1
        return k * k
    return task


def _fails(judge):
    raise ValueError("no deployment")


def _hangs(judge):
    time.sleep(600)


def test_results_come_in_the_tasks_order_with_every_workers_judgements():
    judge = _Judge()
    assert run_tasks(judge, [_square(k) for k in range(4)], workers=2) == [0, 1, 4, 9]
    assert judge.cache == {0: 0, 1: 1, 2: 4, 3: 9} and judge.runs == 4


def _drains(signum, frame):
    pass  # a server's handler: note the request to stop, go on


@pytest.mark.timeout(60)
@pytest.mark.parametrize("handler", [_on_sigterm, _drains], ids=["raises", "drains"])
def test_a_failing_task_ends_the_pool_at_once_whatever_the_sigterm_handler(handler):
    before = signal.signal(signal.SIGTERM, handler)
    try:
        start = time.monotonic()
        with pytest.raises(ValueError, match="no deployment"):
            run_tasks(_Judge(), [_hangs, _fails], workers=2)
        assert time.monotonic() - start < 30
        assert signal.getsignal(signal.SIGTERM) is handler  # the parent's handler is back
    finally:
        signal.signal(signal.SIGTERM, before)
    assert multiprocessing.active_children() == []
