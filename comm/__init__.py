"""Communication: Group (one process group, counted) and the MoE Dispatcher."""

__all__ = ["Group"]


def __getattr__(name):
    # lazy (PEP 562): atoll.comm.experts is plain arithmetic the planner imports without torch
    if name == "Group":
        from atoll.comm.group import Group

        return Group
    raise AttributeError(f"module 'atoll.comm' has no attribute {name!r}")
