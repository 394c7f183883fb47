"""A writer killed mid-message: on a channel shared with other writers it takes their messages
with it (the reader waits for the rest of its message for ever: why a disaggregated job's
engines each answer on their own channel); with one channel each (engine.driver.channels.Merged)
the others' messages still come."""

import os
import queue
import signal
import threading
import time

from channel_fns import put_big_then_wait, put_small

from atoll.engine.driver.channels import Merged
from atoll.launch.local import _SPAWN, channel

BIG = 4 << 20  # far over a pipe's 64 KiB: the writer blocks part-way, its queue's write lock held


def _start(fn, *args):
    p = _SPAWN.Process(target=fn, args=args, daemon=True)
    p.start()
    return p


def _killed_mid_write(ch) -> None:
    """A writer that put a big message nobody reads, killed while its feeder thread writes it."""
    p = _start(put_big_then_wait, ch, BIG)
    time.sleep(1.5)  # it is blocked part-way through the pipe
    os.kill(p.pid, signal.SIGKILL)
    p.join(5)


def _get_within(reader, timeout_s: float) -> list:
    """What reader.get gave within timeout_s (run in a thread: a read that never returns is the failure)."""
    got = []

    def read():
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            try:
                msg = reader.get(timeout=0.2)
            except queue.Empty:
                continue
            if isinstance(msg, str):
                got.append(msg)
                return

    t = threading.Thread(target=read, daemon=True)
    t.start()
    t.join(timeout_s + 1)
    return got


def test_a_shared_channel_is_lost_with_a_writer_killed_mid_message():
    ch = channel()
    _killed_mid_write(ch)
    other = _start(put_small, ch, "from the live engine")
    try:
        assert _get_within(ch, 3.0) == []  # the reader is stuck in the dead writer's half message
    finally:
        other.kill()


def test_merged_channels_keep_the_live_writers_messages():
    dead, live = channel(), channel()
    _killed_mid_write(dead)  # (before the reader starts: as when the reader lags behind the writers)
    other = _start(put_small, live, "from the live engine")
    merged = Merged([dead, live]).start()
    try:
        assert _get_within(merged, 10.0) == ["from the live engine"]
    finally:
        other.kill()
        merged.close()
