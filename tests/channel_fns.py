"""Writers for tests/engine/driver/test_channels.py (importable by spawned processes)."""

import time


def put_big_then_wait(channel, nbytes: int) -> None:
    """Put one message larger than a pipe holds (nobody reads it yet), then stay alive."""
    channel.put(b"x" * nbytes)
    time.sleep(120)


def put_small(channel, text: str) -> None:
    channel.put(text)
    time.sleep(120)
