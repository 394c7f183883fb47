"""How every launcher calls a rank's function, handing it what the launcher knows."""

from __future__ import annotations

import inspect
import os

from atoll.launch.device import rank_device
from atoll.launch.net import node_name


def call_rank(fn, rank: int, world_size: int, args=(), kwargs=None):
    """fn(rank, world_size, *args, **kwargs), handing the rank the facts its launcher knows,
    each to a function that takes that keyword: `device` (the device bound here), `node` (the
    node it runs on: the launcher's name for it, else the host name) and `ranks_here` (ranks
    sharing this machine). How every launcher calls a rank's function."""
    kwargs = dict(kwargs or {})
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):  # a builtin or a callable without a signature
        params = {}
    facts = {"device": rank_device, "node": node_name,
             "ranks_here": lambda: int(os.environ.get("LOCAL_WORLD_SIZE", world_size))}
    for name, fact in facts.items():
        if name in params and name not in kwargs:
            kwargs[name] = fact()
    return fn(rank, world_size, *args, **kwargs)
