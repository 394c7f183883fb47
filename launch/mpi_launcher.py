"""Running under mpirun / srun (Open MPI, MPICH, PMIx): bootstrap torch.distributed from MPI.

mpirun starts the processes; mpi4py gives each its rank and the world size, and rank 0
broadcasts the rendezvous address (its own address and a port it already listens on).
When every rank is on one host the rendezvous stays on 127.0.0.1; across hosts rank 0 uses
its address on the route to the other hosts, and each rank pins gloo/NCCL to the interface
holding its own address on the route to rank 0. ATOLL_MASTER_ADDR overrides rank 0's choice;
GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME, when set, win over the interface atoll picks.

A rank whose fn raises prints one line to stderr and aborts the MPI job (MPI_Abort), so
mpirun ends every rank at once instead of leaving them blocked in a collective.
"""

from __future__ import annotations

import os
import socket
import sys
import time

from atoll.errors import AtollError, LaunchError, LayoutError, RankFailure
from atoll.launch.device import bind, decide
from atoll.launch.net import listen_socket, pin_interface, rendezvous, route_ip_to
from atoll.launch.rank import call_rank
from atoll.parallel.placement import check_job_placement

_ENV_RANK = ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK")
# errors that only say a peer went away: the peer's own failure (its abort line, or mpirun's
# "exited on signal" report) is the cause to show, so such a rank waits before aborting
_PEER_GONE = ("Connection closed by peer", "Connection reset by peer", "Broken pipe",
              "remote process exited", "NCCL communicator was aborted")
_PEER_GRACE_S = 5.0


def in_mpi() -> bool:
    """True inside a process that mpirun (or srun with PMI/PMIx) started."""
    return any(k in os.environ for k in _ENV_RANK)


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError:
        raise LaunchError("the MPI launcher needs mpi4py: pip install 'atoll[mpi]' and Open MPI "
                          "(apt-get install openmpi-bin libopenmpi-dev)") from None
    except RuntimeError as e:  # mpi4py present but no MPI library it can load
        raise LaunchError(f"mpi4py could not load an MPI library ({e}): install Open MPI "
                          "(apt-get install openmpi-bin libopenmpi-dev)") from None
    return MPI


def start_mpi() -> None:
    """Initialise MPI here (importing mpi4py does), in the thread that will end it at exit,
    before a rank's work moves to another thread (launch.rank_job)."""
    _mpi()


def _master_address(comm) -> str:
    """Rank 0's rendezvous address: loopback on one host, else its route to another host."""
    hosts = comm.allgather(socket.gethostname())
    if comm.Get_rank() != 0:
        return ""
    explicit = os.environ.get("ATOLL_MASTER_ADDR")
    if explicit:
        return explicit
    others = [h for h in hosts if h != hosts[0]]
    if not others:
        return "127.0.0.1"
    try:
        return route_ip_to(others[0])
    except OSError:
        return socket.gethostbyname(hosts[0])


def run_mpi(fn, world_size: int, *args, abort_on_error: bool = True, timeout_s: float = 600.0,
            device: str = "cpu", placement=None, strict_placement: bool = False, **kwargs):
    """Join the MPI job, rendezvous torch.distributed, run fn(rank, world_size, *args, **kwargs).

    Returns (rank, value) on every rank. When fn raises on a rank, that rank prints
    `atoll: rank R on HOST failed: CAUSE` and aborts the whole job (exit code 2); with
    abort_on_error=False it raises RankFailure instead and leaves ending the job to the caller.
    """
    MPI = _mpi()
    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    if size != world_size:
        raise LayoutError(f"the layout needs {world_size} ranks but mpirun started {size}")
    import torch  # lazy: launch/ is torch-free until a rank runs

    local = comm.Split_type(MPI.COMM_TYPE_SHARED)  # the ranks on this host
    local_rank, local_size = local.Get_rank(), local.Get_size()
    local.Free()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local_size))
    host = socket.gethostname()
    try:
        if placement is not None:  # every rank's host and local rank (its GPU) against the plan
            every = comm.allgather((host, local_rank))
            line = check_job_placement(placement, [h for h, _ in every], [g for _, g in every],
                                       strict=strict_placement)
            if line and rank == 0:
                print(f"atoll: warning: {line}", file=sys.stderr, flush=True)
        value = _run(comm, fn, rank, size, local_rank, device, args, kwargs, timeout_s)
    except BaseException as e:
        line = str(e) if isinstance(e, AtollError) else f"{type(e).__name__}: {e}"
        if not abort_on_error:
            raise RankFailure(rank, line, node=host) from e
        if any(p in line for p in _PEER_GONE):
            time.sleep(_PEER_GRACE_S)  # mpirun usually ends this rank first, naming the real one
        print(f"atoll: error: rank {rank} on {host} failed: {line}", file=sys.stderr, flush=True)
        comm.Abort(2)
    return rank, value


def _run(comm, fn, rank, size, local_rank, requested, args, kwargs, timeout_s):
    import torch.distributed as dist

    device = decide(requested, local_rank)  # MPI's own view of the node, not an env variable
    if size == 1:
        bind(device)
        return call_rank(fn, rank, size, args, kwargs)
    addr = _master_address(comm)
    listen = None
    if rank == 0:
        listen = listen_socket(addr)
        target = f"{addr}:{listen.getsockname()[1]}"
    else:
        target = None
    target = comm.bcast(target, root=0)
    addr, port = target.rsplit(":", 1)
    pin_interface("127.0.0.1" if addr.startswith("127.") else route_ip_to(addr))
    rendezvous(rank, size, addr, int(port), device=device, requested=requested, listen=listen,
               timeout_s=timeout_s)
    value = call_rank(fn, rank, size, args, kwargs)
    dist.destroy_process_group()  # only after success: a failed rank aborts the job instead
    return value
