"""The rank processes a job spawned, read from /proc (for tests that kill one of them)."""

from pathlib import Path


def spawned_children(pid: int) -> list[int]:
    """Process ids of pid's children that multiprocessing's spawn started, sorted."""
    kids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        if int(fields[1]) == pid and b"spawn_main" in cmdline:
            kids.append(int(stat.parent.name))
    return sorted(kids)
