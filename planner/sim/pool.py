"""The SLO search's independent judgements on every core: each finalist (its replicas, or its
fewest replicas at a rate) and each xPyD split is a task, run in a forked worker process with the
parent's judge, and its judgements merged back into the parent's cache in the tasks' order, so
the result does not depend on which worker finished first.

One core, or a platform without fork: the tasks run one after another in this process.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import threading

_WORK: tuple | None = None  # (judge, tasks), inherited by the forked workers


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run_tasks(judge, tasks: list, *, workers: int | None = None) -> list:
    """[task(judge) for task in tasks], on up to `workers` processes (default: the cores this
    process may use). Each worker's judgements land in judge.cache and its runs in judge.runs;
    progress advances by a task's runs as it ends."""
    workers = min(len(tasks), workers or cores())
    if workers <= 1 or "fork" not in multiprocessing.get_all_start_methods():
        return [task(judge) for task in tasks]
    global _WORK
    _WORK = (judge, tasks)
    try:
        with _forked_pool(workers) as pool:
            done = {}
            for i, out, cache, runs in pool.imap_unordered(_work, range(len(tasks))):
                done[i] = (out, cache, runs)
                if judge.progress is not None:
                    judge.progress(runs)
    finally:
        _WORK = None
    results = []
    for i in range(len(tasks)):
        out, cache, runs = done[i]
        for d, j in cache.items():
            judge.cache.setdefault(d, j)
        judge.runs += runs
        results.append(out)
    return results


def _forked_pool(workers: int):
    """A fork pool whose workers die on the SIGTERM of its terminate. A worker inherits its
    parent's handlers at the fork, and one that raises instead (the CLI's) may not run in a
    worker stuck on a lock another thread of the parent held when it forked: the default one is
    in place while the workers are forked, and again in each as it starts."""
    main = threading.current_thread() is threading.main_thread()
    before = signal.signal(signal.SIGTERM, signal.SIG_DFL) if main else None
    try:
        return multiprocessing.get_context("fork").Pool(workers, initializer=_plain_signals)
    finally:
        if main:
            signal.signal(signal.SIGTERM, before)


def _plain_signals() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles ^C and ends the pool


def _work(i: int):
    judge, tasks = _WORK
    judge.progress = None  # the parent draws the bar
    before, runs = set(judge.cache), judge.runs
    out = tasks[i](judge)
    return i, out, {d: j for d, j in judge.cache.items() if d not in before}, judge.runs - runs
