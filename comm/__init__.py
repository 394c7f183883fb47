from atoll.comm.group import Group

__all__ = ["Group"]
