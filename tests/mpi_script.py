"""Run under mpirun by test_mpi_launcher.py; each rank writes OUT/rank-R.json
({"rank": R, "value": ...} or {"error": the AtollError line}); mpirun's forwarded stdout
can run two ranks' lines together, so results go to files.

    mpirun -np 4 --oversubscribe --allow-run-as-root python tests/mpi_script.py OUT collective
    mpirun -np 4 ... python tests/mpi_script.py OUT raise       # rank 1 raises
    mpirun -np 4 ... python tests/mpi_script.py OUT die         # rank 3 is SIGKILLed
    mpirun -np 2 ... python tests/mpi_script.py OUT collective  # the wrong world size
"""

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from launch_fns import collective, die_on_rank, raise_on_rank  # noqa: E402

from atoll.errors import AtollError  # noqa: E402
from atoll.launch.mpi_launcher import in_mpi, run_mpi  # noqa: E402


def main() -> None:
    assert in_mpi(), "run me under mpirun"
    out, mode = Path(sys.argv[1]), sys.argv[2]
    me = next(os.environ[k] for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK") if k in os.environ)
    try:
        rank, value = run(mode, out)
    except AtollError as e:  # as the CLI does: one line, exit 2
        (out / f"rank-{me}.json").write_text(json.dumps({"error": str(e)}))
        sys.exit(2)
    (out / f"rank-{rank}.json").write_text(json.dumps({"rank": rank, "value": value}))


def run(mode: str, out: Path):
    if mode == "collective":
        return run_mpi(collective, 4)
    if mode == "raise":
        return run_mpi(raise_on_rank, 4, 1, str(out))
    if mode == "die":
        return run_mpi(die_on_rank, 4, 3, str(out))
    raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
