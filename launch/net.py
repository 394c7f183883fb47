"""Which address and interface a rank uses, made explicit.

Multi-node jobs whose first collective hangs have usually let gloo or NCCL guess the
interface (a hostname resolving to 127.0.1.1, a docker bridge). Launchers here pick the
rendezvous address themselves and pin GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME to the
interface that holds this rank's own address, unless the user already set them.
"""

from __future__ import annotations

import os
import socket
import time
from datetime import timedelta

from atoll.errors import LaunchError
from atoll.launch.device import agree_through_store, backend_for, bind

NODE_VAR = "ATOLL_NODE"  # set by a launcher whose nodes are not hosts: the Ray launcher's node id


def node_name() -> str:
    """The node this rank runs on: the launcher's name for it (NODE_VAR), else the host name."""
    return os.environ.get(NODE_VAR) or socket.gethostname()


def route_ip_to(host: str) -> str:
    """This machine's address on the route to `host` (a UDP connect sends no packet)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return s.getsockname()[0]


def ifname_for(ip: str) -> str | None:
    """The name of the interface that holds IPv4 address `ip`, or None (Linux only)."""
    if ip.startswith("127."):
        return "lo"
    try:
        import fcntl
        import struct
    except ImportError:
        return None
    siocgifaddr = 0x8915
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                req = struct.pack("256s", name.encode()[:15])
                addr = socket.inet_ntoa(fcntl.ioctl(s.fileno(), siocgifaddr, req)[20:24])
            except OSError:
                continue
            if addr == ip:
                return name
    return None


def pin_interface(own_ip: str) -> str | None:
    """Point gloo and NCCL at the interface holding own_ip (the user's settings win)."""
    name = ifname_for(own_ip)
    if name is not None:
        os.environ.setdefault("GLOO_SOCKET_IFNAME", name)
        os.environ.setdefault("NCCL_SOCKET_IFNAME", name)
    return os.environ.get("GLOO_SOCKET_IFNAME")


def listen_socket(ip: str) -> socket.socket:
    """A listening socket on ip:<free port>, held until the rendezvous store takes it over,
    so no other process can take the port in between."""
    s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind((ip, 0))
    s.listen(1024)
    return s


def rendezvous(rank: int, world_size: int, addr: str, port: int, *, device: str = "cpu",
               requested: str = "cpu", listen: socket.socket | None = None,
               arrive_timeout_s: float = 120.0, timeout_s: float = 600.0) -> str:
    """Agree on the device, bind it, then init_process_group over a TCPStore served by rank 0
    on addr:port; returns this rank's final device (launch.device: `auto` is CUDA only when
    every rank chose CUDA; the backend follows the device).

    Rank 0 passes `listen` (from listen_socket) so the store listens on that address only;
    torch's own tcp:// rendezvous listens on every interface. Rank 0 then waits for every
    rank to check in and names the ones that did not, instead of a bare collective timeout.
    """
    import torch.distributed as dist

    fd = listen.detach() if (rank == 0 and listen is not None) else None
    store = dist.TCPStore(addr, port, world_size, rank == 0, timedelta(seconds=timeout_s),
                          wait_for_workers=False, master_listen_fd=fd)
    store.set(f"atoll/arrived/{rank}", "1")
    if rank == 0:
        deadline = time.monotonic() + arrive_timeout_s
        missing = list(range(world_size))
        while missing:
            missing = [r for r in missing if not store.check([f"atoll/arrived/{r}"])]
            if missing and time.monotonic() > deadline:
                raise LaunchError(f"ranks {missing} did not reach the rendezvous at {addr}:{port} "
                                  f"within {arrive_timeout_s:.0f}s")
            if missing:
                time.sleep(0.05)
    device = bind(agree_through_store(store, rank, world_size, device, requested))
    dist.init_process_group(backend_for(device), store=store, rank=rank, world_size=world_size,
                            timeout=timedelta(seconds=timeout_s))
    return device
