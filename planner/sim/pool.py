"""The SLO search's independent judgements on every core: each finalist (its replicas, or its
fewest replicas at a rate) and each xPyD split is a task, run in a forked worker process with the
parent's judge, and its judgements merged back into the parent's cache in the tasks' order, so
the result does not depend on which worker finished first.

One core, or a platform without fork: the tasks run one after another in this process.
"""

from __future__ import annotations

import multiprocessing
import os

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
        with multiprocessing.get_context("fork").Pool(workers) as pool:
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


def _work(i: int):
    judge, tasks = _WORK
    judge.progress = None  # the parent draws the bar
    before, runs = set(judge.cache), judge.runs
    out = tasks[i](judge)
    return i, out, {d: j for d, j in judge.cache.items() if d not in before}, judge.runs - runs
