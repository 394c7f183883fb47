"""Killing one rank mid-generation ends the whole job within seconds, naming the rank."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from procs import spawned_children


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.skipif(not Path("/proc").exists(), reason="reads the process table from /proc")
def test_killing_a_rank_ends_the_job(tiny_model, tmp_path):
    d = tiny_model("llama", num_hidden_layers=4)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt_token_ids": [i + 1, 2]}) + "\n" for i in range(16)))
    # a long run: 16 sequences one at a time x 250 tokens, so the kill lands mid-generation
    cmd = [sys.executable, "-m", "atoll", "generate", "--model", str(d), "--prompts", str(prompts),
           "--layout", "TP2PP2", "--max-new-tokens", "250", "--max-num-seqs", "1", "--output", str(tmp_path / "out.jsonl")]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 90
        while len(spawned_children(proc.pid)) < 4 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.2)
        workers = spawned_children(proc.pid)
        assert len(workers) == 4, f"expected 4 rank processes, found {workers}"
        time.sleep(8)  # past model loading, into the decode loop
        assert proc.poll() is None, "the job finished before the kill; make it longer"
        os.kill(workers[-1], signal.SIGKILL)
        killed_at = time.monotonic()
        _, err = proc.communicate(timeout=60)
        took = time.monotonic() - killed_at
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 2, err
    assert took < 15, f"the job took {took:.1f}s to end after the kill"
    assert "failed: killed by SIGKILL" in err and "rank " in err, err
    assert "Traceback" not in err
    rows = [json.loads(line) for line in (tmp_path / "out.jsonl").read_text().splitlines()]
    assert sorted(r["id"] for r in rows) == list(range(16))  # every request listed
    # a fast machine finishes a few sequences before the kill: those keep their output; every
    # other one is listed as failed, naming the cause
    failed = [r for r in rows if "error" in r]
    finished = [r for r in rows if "error" not in r]
    assert failed, "no request was in flight at the kill; make the run longer"
    assert all("killed by SIGKILL" in r["error"] for r in failed)
    assert all(r["finish_reason"] in ("length", "stop") and r["token_ids"] for r in finished)
    for pid in workers:  # no rank left behind
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2]
