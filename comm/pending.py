"""Pending: a collective started with async_op=True, and the generator protocol of an
overlapped step (two-batch overlap: engine/step/two_batch.py).

    got = group.all_to_all(x, send, recv, async_op=overlap)  # a Pending, the exchange under way
    yield                                                      # let the other micro-batch compute
    rows = ready(got)

A step that can overlap its collectives is written once, as a generator that starts each
collective, yields while it flies, and waits on it when resumed; `run(steps)` drives one to its
end (the plain path, overlap=False: each collective blocking, as before), and two_batch.interleave drives two in turns.
On gloo the exchange runs on the process group's own threads while Python goes on; on NCCL on
the communicator's stream, wait() making the compute stream wait for it (no host sync, so a
captured CUDA graph holds it). `then` chains host-free work to do on the result at wait().
"""

from __future__ import annotations


class Pending:
    def __init__(self, work, value, then=None):
        self.work, self.value, self.then = work, value, then

    @classmethod
    def done(cls, value) -> "Pending":
        """A result already there (a size-1 group, or a path that does not overlap)."""
        return cls(None, value)

    def map(self, fn) -> "Pending":
        """The same collective, fn applied to its result at wait()."""
        before = self.then
        return Pending(self.work, self.value, fn if before is None else (lambda v: fn(before(v))))

    def wait(self):
        if self.work is not None:
            self.work.wait()
            self.work = None
        value, self.value = self.value, None
        return value if self.then is None else self.then(value)


def ready(value):
    """A collective's result: a Pending waited for, or what a blocking call returned."""
    return value.wait() if isinstance(value, Pending) else value


def run(steps):
    """Drive an overlapped step's generator to its end; returns its return value."""
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value
