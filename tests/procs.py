"""The rank processes a job started, read from /proc (for tests that kill one of them)."""

from pathlib import Path


def _processes() -> list[tuple[int, int, bytes]]:
    """(pid, parent pid, command line) of every process."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            cmdline = (stat.parent / "cmdline").read_bytes()
        except OSError:
            continue
        out.append((int(stat.parent.name), int(fields[1]), cmdline))
    return out


def spawned_children(pid: int) -> list[int]:
    """Process ids of the ranks that driver `pid` started through multiprocessing, sorted: its
    spawned children, and the children of its fork server (launch.local forks ranks there)."""
    procs = _processes()
    servers = {p for p, parent, cmd in procs if parent == pid and b"multiprocessing.forkserver" in cmd}
    return sorted(p for p, parent, cmd in procs
                  if (parent == pid and b"spawn_main" in cmd) or parent in servers)
