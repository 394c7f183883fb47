"""Timing on any device: a CPU runs each call before returning, a GPU queues it, so every
timer synchronizes the device before it starts and after the last repeat. Between the two the
host launches ahead of the device, as the runtime's own steps do, so a kernel's launch costs
only where the device would otherwise wait for it."""

from __future__ import annotations

import time

MAX_REPS = 200


def is_cuda(device) -> bool:
    return str(device).startswith("cuda")


def sync(device) -> None:
    """Wait for the work queued on `device` (nothing to wait for on a CPU)."""
    if is_cuda(device):
        import torch  # lazy: `atoll --help` imports this module (bench's model_rank)

        torch.cuda.synchronize(device)


def timed(fn, budget_s: float, least: int = 2, device="cpu") -> float:
    """Mean seconds of fn() over repeats filling about budget_s (at least `least`, at most
    MAX_REPS), after one warm-up; the repeat count comes from one synchronized call, so a
    queue of GPU work never runs far past the budget. The mean, not the median: on a machine
    shared with other jobs a sustained run loses the core for part of the time, and so do the
    runs the figures predict."""
    fn()
    sync(device)
    t = time.perf_counter()
    fn()
    sync(device)
    one = time.perf_counter() - t
    reps = max(least, min(MAX_REPS, int(budget_s / max(one, 1e-9))))
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    sync(device)
    return (time.perf_counter() - t0) / reps
