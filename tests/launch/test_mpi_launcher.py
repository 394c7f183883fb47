"""The MPI launcher under Open MPI's mpirun: 4 ranks on this machine, everything on loopback."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from atoll.errors import LaunchError
from atoll.launch.mpi_launcher import in_mpi, run_mpi

from paths import TESTS as HERE  # noqa: E402  (mpi_script.py)
MPIRUN = shutil.which("mpirun")
needs_mpirun = pytest.mark.skipif(
    MPIRUN is None or importlib.util.find_spec("mpi4py") is None,
    reason="needs Open MPI's mpirun (apt-get install openmpi-bin libopenmpi-dev) and mpi4py")


def run_mpirun(np: int, argv: list, timeout: float = 180) -> subprocess.CompletedProcess:
    """argv (after python) on np ranks of mpirun, everything on loopback."""
    cmd = [MPIRUN, "-np", str(np), "--oversubscribe", "--allow-run-as-root", "--bind-to", "none",
           # MPI's own traffic on loopback only, and no probing for InfiniBand
           "--mca", "btl", "self,tcp", "--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo",
           sys.executable, *argv]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "PMIX_"))}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def mpirun(np: int, out: Path, *args, timeout: float = 180):
    """Run tests/mpi_script.py on np ranks; returns (returncode, what each rank wrote, stderr)."""
    proc = run_mpirun(np, [str(HERE / "mpi_script.py"), str(out), *args], timeout=timeout)
    lines = [json.loads(p.read_text()) for p in sorted(out.glob("rank-*.json"))]
    return proc.returncode, lines, proc.stdout + proc.stderr


def test_in_mpi(monkeypatch):
    for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.delenv(k, raising=False)
    assert not in_mpi()
    for k in ("OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"):
        monkeypatch.setenv(k, "0")
        assert in_mpi()
        monkeypatch.delenv(k)


def test_mpi4py_missing_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py -> ImportError
    with pytest.raises(LaunchError) as info:
        run_mpi(lambda rank, world: rank, 4)
    assert str(info.value) == ("the MPI launcher needs mpi4py: pip install 'atoll[mpi]' and Open MPI "
                               "(apt-get install openmpi-bin libopenmpi-dev)")


@needs_mpirun
def test_four_ranks_collectives(tmp_path):
    rc, lines, err = mpirun(4, tmp_path, "collective")
    assert rc == 0, err
    by_rank = {ln["rank"]: ln["value"] for ln in lines}
    assert sorted(by_rank) == [0, 1, 2, 3], lines
    for rank, v in by_rank.items():
        assert v["rank"] == rank
        assert v["sum"] == 10.0
        assert v["gathered"] == [[0.0, 0.0], [1.0, 1.0], [2.0, 4.0], [3.0, 9.0]]
        assert v["backend"] == "gloo"
    assert len({v["pid"] for v in by_rank.values()}) == 4


@needs_mpirun
def test_wrong_world_size_is_one_line(tmp_path):
    rc, lines, err = mpirun(2, tmp_path, "collective", timeout=120)
    assert rc == 2, err
    assert lines == [{"error": "the layout needs 4 ranks but mpirun started 2"}] * 2, lines


@needs_mpirun
def test_a_rank_that_raises_aborts_the_job(tmp_path):
    rc, lines, err = mpirun(4, tmp_path, "raise")
    ended = time.time()
    took = ended - float((tmp_path / "failed-at").read_text())
    assert rc == 2, err
    assert lines == [], lines
    ours = [ln for ln in err.splitlines() if ln.startswith("atoll: ")]
    # the raising rank's line only: the others die waiting, without blaming each other
    assert len(ours) == 1 and ours[0].startswith("atoll: error: rank 1 on "), err
    assert ours[0].endswith(" failed: ValueError: bad input on rank 1"), err
    assert took < 15, f"mpirun took {took:.1f}s to end after rank 1 raised"


@needs_mpirun
def test_a_killed_rank_ends_the_job(tmp_path):
    rc, lines, err = mpirun(4, tmp_path, "die")
    took = time.time() - float((tmp_path / "failed-at").read_text())
    assert rc != 0 and lines == [], (rc, lines, err)
    assert "process rank 3" in err and "signal 9" in err, err  # mpirun names the killed rank
    assert "atoll: error: rank" not in err, err  # survivors do not blame their own peers
    assert took < 15, f"mpirun took {took:.1f}s to end after rank 3 was killed"


@pytest.mark.slow
@needs_mpirun
def test_generate_tp2pp2_matches_local(tmp_path, tiny_model):
    """`atoll generate` under mpirun: rank 0 drives the living engine and writes the output,
    the other ranks serve until it stops them; the local launcher's tokens."""
    from gen_common import PROMPTS, local_tokens

    model = tiny_model("llama", num_hidden_layers=4)
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt_token_ids": p}) + "\n" for i, p in enumerate(PROMPTS)))
    run = run_mpirun(4, ["-m", "atoll", "generate", "--model", str(model), "--prompts", str(prompts), "-tp", "2",
                         "-pp", "2", "--max-new-tokens", "8", "--output", str(out), "--no-progress"], timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    got = [r["token_ids"] for r in map(json.loads, out.read_text().splitlines())]
    assert got == local_tokens(model)  # no EOS among them: 8 tokens each, as with ignore_eos


@pytest.mark.parametrize("env", [{"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"},
                                 {"OMPI_COMM_WORLD_RANK": "1"}])
def test_a_rank_leaves_at_once_with_its_code_and_its_output(env):
    """A torchrun/mpirun rank ends through leave_job: its exit code and its buffered output kept,
    nothing after it run (interpreter shutdown, where gloo's threads could abort the process)."""
    code = ("import sys, torch.distributed; from atoll.launch.leave import leave_job; "
            "sys.stdout.write('written'); leave_job(3); raise SystemExit(9)")
    base = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "PMIX_", "RANK", "MASTER_"))}
    proc = subprocess.run([sys.executable, "-c", code], env={**base, **env}, capture_output=True, text=True,
                          timeout=120)
    assert (proc.returncode, proc.stdout) == (3, "written"), proc.stderr
    plain = subprocess.run([sys.executable, "-c", code], env=base, capture_output=True, text=True, timeout=120)
    assert plain.returncode == 9  # outside a job it returns and the interpreter ends as usual
