"""torchrun: the same `atoll generate` command gives the local launcher's tokens, and
another engine's own process groups drive atoll's layers (examples/own_process_groups.py)."""

import json
import os
import re
import shutil
import subprocess
import sys

import pytest

from atoll import LLM, SamplingParams
from atoll.launch.local import free_port

from paths import REPO as ROOT  # noqa: E402
PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3]]
torchrun = pytest.mark.skipif(shutil.which("torchrun") is None, reason="torchrun is not on PATH")


def _torchrun(args, cwd):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "4",
           "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=240)


@pytest.mark.slow
@torchrun
@pytest.mark.timeout(300)
def test_torchrun_generate_matches_local(tiny_model, tmp_path):
    d = tiny_model("llama", num_hidden_layers=4)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt_token_ids": p}) + "\n" for i, p in enumerate(PROMPTS)))
    out = tmp_path / "out.jsonl"
    run = _torchrun(["-m", "atoll", "generate", "--model", str(d), "--prompts", str(prompts), "-tp", "2", "-pp", "2",
                     "--max-new-tokens", "8", "--output", str(out), "--no-progress"], tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    got = {r["id"]: r["token_ids"] for r in map(json.loads, out.read_text().splitlines())}
    local = LLM(d, layout="TP2PP2").generate(PROMPTS, SamplingParams(max_tokens=8))
    assert got == {i: o.token_ids for i, o in enumerate(local)}


@torchrun
@pytest.mark.timeout(300)
def test_engine_with_its_own_process_groups(tmp_path):
    run = _torchrun([str(ROOT / "examples" / "own_process_groups.py")], tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    # four processes share one pipe, so their lines may interleave: look for each rank's words
    assert sorted(re.findall(r"rank (\d) ok", run.stdout)) == ["0", "1", "2", "3"], run.stdout
