"""How a process that torchrun or mpirun started ends once its command is done.

A gloo process group keeps worker threads that may still release the tensors of the job's
last collective after the main thread has returned. If that happens while the interpreter is
shutting down, the thread cannot take the GIL and the process aborts (signal 6), so a job whose
work all succeeded exits with 134. A rank therefore leaves at once: stdio flushed, MPI
finalised (mpirun counts a rank that never finalises as failed), then os._exit.
"""

from __future__ import annotations

import os
import sys

from atoll.launch.mpi_launcher import in_mpi
from atoll.launch.torchrun import in_torchrun


def leave_job(code: int) -> None:
    """End this process now with `code` if it is a torchrun/mpirun rank whose command used
    torch.distributed; otherwise return and let the interpreter end as usual."""
    if not (in_torchrun() or in_mpi()) or "torch.distributed" not in sys.modules:
        return
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a reader that left, a closed stream: nothing more to say
            pass
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and mpi.Is_initialized() and not mpi.Is_finalized():
        mpi.Finalize()
    os._exit(code)
