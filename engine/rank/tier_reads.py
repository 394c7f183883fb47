"""Reading a prompt's blocks from the KV tiers while the engine goes on (engine/rank/kv_tiers.py).

When the scheduler admits a prompt whose leading blocks left the device pool, the ranks agree
on how many of them their tiers hold (each rank's index, one all-reduce), and if any, a reader
thread fetches and checks them. The prompt steps aside (the scheduler's `loading`) and the
other requests' ticks go on. At the start of every tick while reads are out, the ranks agree
which reads every one of them has finished, and on how many blocks each read got (one
all-reduce for all of them; the reads are started in the same order on every rank, so the
same list). A finished read's prompt goes back to the head of the line and takes its blocks.
"""

from __future__ import annotations

from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait

import torch


class Reads:
    """The reads in flight on one rank, by request index, and the finished ones."""

    def __init__(self, chain, group, device):
        self.chain, self.group, self.device = chain, group, device
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="atoll-kv-read")
        self._out: dict[int, tuple[list[bytes], Future]] = {}  # index -> (names, read)
        self._done: dict[int, tuple[list[bytes], list[bytes]]] = {}  # index -> (names, agreed payloads)
        self._dropped: set[int] = set()  # reads out for requests that left: agreed, then dropped

    def _agree(self, values: list[int]) -> list[int]:
        if self.group.size == 1:
            return values
        t = torch.tensor(values, dtype=torch.long, device=self.device)
        return self.group.all_reduce(t, op="min").tolist()

    def start(self, index: int, names: list[bytes]) -> bool:
        """Start reading the leading `names` the ranks' tiers all hold; False when they hold none."""
        held = self._agree([self.chain.lookup(names)])[0]
        if held == 0:
            return False
        names = names[:held]
        self._out[index] = (names, self._pool.submit(self.chain.fetch, names))
        return True

    def poll(self) -> None:
        """Agree which reads every rank has finished (called by every rank at each tick's start)."""
        if not self._out:
            return
        keys = sorted(self._out)
        mine = [(1, len(f.result())) if f.done() else (0, 0) for _, f in (self._out[k] for k in keys)]
        agreed = self._agree([x for pair in mine for x in pair])
        for i, k in enumerate(keys):
            if agreed[2 * i]:  # finished on every rank: the fewest blocks any rank read
                names, read = self._out.pop(k)
                if k in self._dropped:
                    self._dropped.discard(k)
                    continue
                self._done[k] = (names, read.result()[:agreed[2 * i + 1]])

    def idle(self, timeout_s: float = 0.001) -> None:
        """A tick with nothing to compute while reads are out: wait for one to finish (up to
        timeout_s) rather than spin through empty ticks."""
        if self._out:
            wait([f for _, f in self._out.values()], timeout=timeout_s, return_when=FIRST_COMPLETED)

    def ready(self, index: int) -> bool:
        return index in self._done

    def reading(self, index: int) -> bool:
        return index in self._out

    def take(self, index: int, names: list[bytes]) -> list[bytes]:
        """The payloads read for request `index` that continue `names` (the blocks the prompt
        still needs, which the device pool may have changed since the read began)."""
        read_names, payloads = self._done.pop(index)
        return continuing(read_names, payloads, names)

    def cancel(self, index: int) -> None:
        """The request left: its read's result is dropped (every rank at the same tick)."""
        self._done.pop(index, None)
        if index in self._out:  # it finishes, is agreed like the others, and is dropped then
            self._dropped.add(index)

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)


def continuing(read_names: list[bytes], payloads: list[bytes], names: list[bytes]) -> list[bytes]:
    """The payloads read (for read_names, in order) that give the leading blocks of `names`."""
    if not names or names[0] not in read_names[:len(payloads)]:
        return []
    k = read_names.index(names[0])
    out = []
    for payload, have, want in zip(payloads[k:], read_names[k:], names):
        if have != want:
            break
        out.append(payload)
    return out
