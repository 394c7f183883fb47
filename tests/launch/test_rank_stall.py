"""A rank frozen by SIGSTOP ends the job within seconds, naming that rank (its heartbeat
stops; the others only wait for it), and no rank outlives a driver killed by SIGKILL."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import spawned_children

pytestmark = [pytest.mark.timeout(200),
              pytest.mark.skipif(not Path("/proc").exists(), reason="reads the process table from /proc")]


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def _start_long_job(d, tmp_path, layout="TP3"):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt_token_ids": [i + 1, 2]}) + "\n" for i in range(12)))
    cmd = [sys.executable, "-m", "atoll", "generate", "--model", str(d), "--prompts", str(prompts),
           "--layout", layout, "--max-new-tokens", "250", "--max-num-seqs", "1", "--no-progress",
           "--device", "cpu", "--output", str(tmp_path / "out.jsonl")]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    for line in proc.stderr:  # wait until the ranks have loaded and are generating
        if "KV cache:" in line:
            break
    time.sleep(1.0)
    return proc


def test_a_stopped_rank_is_named_within_seconds(tiny_model, tmp_path):
    d = tiny_model("llama", num_attention_heads=6, num_key_value_heads=3, hidden_size=96, intermediate_size=192)
    proc = _start_long_job(d, tmp_path)
    try:
        workers = spawned_children(proc.pid)
        assert len(workers) == 3 and proc.poll() is None, "the job ended before the stop; make it longer"
        os.kill(workers[1], signal.SIGSTOP)  # rank 1: spawn order is rank order
        stopped_at = time.monotonic()
        err = proc.stderr.read()
        proc.wait(timeout=60)
        took = time.monotonic() - stopped_at
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in spawned_children(proc.pid):
            os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 2, err
    assert took < 30, f"the job took {took:.1f}s to end after SIGSTOP"
    assert "rank 1" in err and "no heartbeat" in err, err
    assert "Traceback" not in err
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == list(range(12))  # every request written
    assert all(r.get("token_ids") or "rank 1" in r.get("error", "") for r in rows)
    time.sleep(1)
    assert all(_gone(pid) for pid in workers), "a rank outlived the job"


def _signal_driver(tiny_model, tmp_path, sig, wait_s: float):
    """Start a TP2 job, send its driver `sig`; (process, its stderr, ranks still alive after
    wait_s, which are then killed)."""
    proc = _start_long_job(tiny_model("llama", num_hidden_layers=4), tmp_path, layout="TP2")
    workers = spawned_children(proc.pid)
    assert len(workers) == 2 and proc.poll() is None
    os.kill(proc.pid, sig)
    err = proc.stderr.read()
    proc.wait(timeout=30)
    deadline = time.monotonic() + wait_s
    while not all(_gone(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    left = [pid for pid in workers if not _gone(pid)]
    for pid in left:
        os.kill(pid, signal.SIGKILL)
    return proc, err, left


@pytest.mark.slow
def test_ranks_end_when_the_driver_is_killed(tiny_model, tmp_path):
    _, _, left = _signal_driver(tiny_model, tmp_path, signal.SIGKILL, wait_s=10)
    assert not left, f"ranks {left} outlived their killed driver"


@pytest.mark.slow
def test_sigterm_of_the_driver_writes_every_request_and_leaves_no_rank(tiny_model, tmp_path):
    proc, err, left = _signal_driver(tiny_model, tmp_path, signal.SIGTERM, wait_s=1)
    assert proc.returncode == 143, err
    assert "terminated (SIGTERM)" in err and "Traceback" not in err
    assert not left, f"ranks {left} outlived the job"
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == list(range(12))  # every request written
    assert all(r.get("token_ids") or r.get("error") == "terminated (SIGTERM)" for r in rows)
