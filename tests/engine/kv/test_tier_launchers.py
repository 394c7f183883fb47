"""The KV cache tiers under every launcher: torchrun, mpirun and Ray run the two-turn workload of
test_tier_engine.py at TP2 (each rank stores its own heads' slice, in its own directory). Under
torchrun and mpirun every process is a rank and rank 0 drives the living engine
(tests/tier_job.py), serving the prompts one at a time through a pool of 8 blocks, so every
turn-2 prompt finds its first two blocks in host memory; a second job on the same disk directory
(a restart) then finds them on disk. Tokens are transformers' throughout."""

import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from atoll.engine.kv.tiers.record import HEADER
from atoll.launch.local import free_port
from paths import TESTS
from reference import reference_tokens
from test_tier_engine import NEW, _prompts

ENGINE = dict(max_model_len=128, num_blocks=8, max_num_seqs=1)
MPIRUN = shutil.which("mpirun")
LAUNCHERS = [
    pytest.param("torchrun", marks=pytest.mark.skipif(importlib.util.find_spec("torch.distributed.run") is None,
                                                      reason="torch.distributed.run is missing")),
    pytest.param("mpi", marks=pytest.mark.skipif(MPIRUN is None or importlib.util.find_spec("mpi4py") is None,
                                                 reason="needs Open MPI's mpirun and mpi4py")),
]


def _job(launcher: str, where: Path, model, prompts: list, **engine) -> dict:
    """tests/tier_job.py on 2 ranks of `launcher` (a TP2 engine): what rank 0 wrote."""
    where.mkdir()
    spec, out = where / "job.json", where / "out.json"
    spec.write_text(json.dumps({"model": str(model), "layout": "TP2", "prompts": prompts, "new": NEW,
                                "engine": {**ENGINE, **engine}}))
    _launch(launcher, where, [str(TESTS / "tier_job.py"), launcher, str(spec), str(out)])
    return json.loads(out.read_text())


def _launch(launcher: str, where: Path, script: list) -> None:
    """`python *script` on 2 ranks of torchrun or mpirun, everything on loopback; it must succeed."""
    if launcher == "torchrun":
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
               "--master-port", str(free_port()), *script]
        env = {**os.environ, "GLOO_SOCKET_IFNAME": "lo", "OMP_NUM_THREADS": "1"}
    else:  # as tests/launch/test_mpi_launcher.py runs mpirun: loopback only, no InfiniBand probing
        cmd = [MPIRUN, "-np", "2", "--oversubscribe", "--allow-run-as-root", "--bind-to", "none", "--mca", "btl",
               "self,tcp", "--mca", "btl_tcp_if_include", "lo", "--mca", "oob_tcp_if_include", "lo",
               sys.executable, *script]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("OMPI_", "PMI", "PMIX_"))}
        env["OMP_NUM_THREADS"] = "1"
    run = subprocess.run(cmd, cwd=where, env=env, capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-3000:]


def _records(kv: Path) -> dict[str, dict[str, bytes]]:
    """Each rank directory's block files: {rank dir: {block name: record}} (a file is named by
    the rank's namespace, then the block's name: 16 bytes each, in hex)."""
    return {d.name: {p.name[32:]: p.read_bytes() for p in d.rglob("*") if p.is_file() and not p.name.startswith(".")}
            for d in sorted(kv.iterdir())}


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_tiers_under_torchrun_and_mpirun(tiny_model, tmp_path, launcher):
    model = tiny_model("llama")
    first, second = _prompts(256)
    ref = reference_tokens(model, first + second, NEW)
    kv = tmp_path / "kv"
    live = _job(launcher, tmp_path / "live", model, first + second, kv_offload_gb=0.01, kv_disk_dir=str(kv))
    assert live["errors"] == [None] * len(ref)
    assert live["token_ids"] == ref
    # the pool holds 8 blocks: every turn-2 prompt's first two blocks came from host memory
    assert live["cached_tokens"] == [0] * len(first) + [32] * len(second)
    stats = live["stats"]
    assert stats["kv_tier_host_hits"] == 2 * len(second), stats
    assert (stats["kv_tier_disk_hits"], stats["kv_tier_checksum_misses"], stats["kv_tier_writes_dropped"]) == (0, 0, 0)
    # each rank wrote its own slice to its own directory: the same blocks, different heads
    records = _records(kv)
    assert sorted(records) == ["rank0", "rank1"]
    assert records["rank0"].keys() == records["rank1"].keys() and len(records["rank0"]) >= 3 * len(first)
    for name, rec in records["rank0"].items():
        other = records["rank1"][name]
        assert HEADER.unpack_from(rec)[2] != HEADER.unpack_from(other)[2]  # each rank's own namespace
        assert rec[HEADER.size:] != other[HEADER.size:]

    # a second job on the same directory (a restart), no host tier: turn 2 again, from disk alone
    again = _job(launcher, tmp_path / "again", model, second, kv_disk_dir=str(kv))
    assert again["token_ids"] == ref[len(first):]
    # the first job also stored each turn-2 prompt's third block: every prompt block but the last
    assert again["cached_tokens"] == [48] * len(second)
    assert again["stats"]["kv_tier_disk_hits"] == 3 * len(second), again["stats"]
    assert again["stats"]["kv_tier_checksum_misses"] == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_atoll_generate_feeds_every_prompt_at_once(tiny_model, tmp_path, launcher):
    """`atoll generate` under torchrun/mpirun: one job fed every request at once, one running
    at a time (--max-num-seqs 1) through the 8-block pool. A turn-2 prompt whose blocks are
    being read steps aside and the next one runs meanwhile, evicting blocks it had in the pool:
    it reads again, and every turn-2 prompt still finds 32 tokens (conversation 4's found none
    before RankTiers.held read again)."""
    model = tiny_model("llama")
    first, second = _prompts(256)
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps({"id": i, "prompt_token_ids": p}) + "\n"
                               for i, p in enumerate(first + second)))
    _launch(launcher, tmp_path, ["-m", "atoll", "generate", "--model", str(model), "--prompts", str(prompts),
                                 "-tp", "2", "--max-new-tokens", str(NEW), "--ignore-eos", "--output", str(out),
                                 "--no-progress", "--max-model-len", "128", "--num-blocks", "8", "--max-num-seqs",
                                 "1", "--kv-offload-gb", "0.01", "--kv-disk-dir", str(tmp_path / "kv")])
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["token_ids"] for r in rows] == reference_tokens(model, first + second, NEW)
    assert [r["metrics"]["cached_tokens"] for r in rows] == [0] * len(first) + [32] * len(second)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tiers_under_ray(cluster, tiny_model, tmp_path):
    """The living engine's TP2 ranks as Ray actors on one node of the simulated cluster (conftest's
    `cluster`), the prompts one at a time; then a new engine on the same disk directory."""
    from atoll import SamplingParams
    from atoll.launch.api import LLM, RayLauncher

    model = tiny_model("llama")
    first, second = _prompts(256)
    ref = reference_tokens(model, first + second, NEW)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    kv = tmp_path / "kv"

    def serve(prompts, **kw):
        with LLM(str(model), layout="TP2", launcher=RayLauncher(tp_size=2), **ENGINE, **kw) as llm:
            outs = [llm.generate([p], params)[0] for p in prompts]
            return outs, dict(llm.start().stats)

    outs, stats = serve(first + second, kv_offload_gb=0.01, kv_disk_dir=str(kv))
    assert [o.token_ids for o in outs] == ref
    assert [o.metrics["cached_tokens"] for o in outs] == [0] * len(first) + [32] * len(second)
    assert stats["kv_tier_host_hits"] == 2 * len(second) and stats["kv_tier_checksum_misses"] == 0, stats
    assert sorted(_records(kv)) == ["rank0", "rank1"]
    outs, stats = serve(second, kv_disk_dir=str(kv))  # new actors, an empty device pool
    assert [o.token_ids for o in outs] == ref[len(first):]
    assert [o.metrics["cached_tokens"] for o in outs] == [48] * len(second)
    assert stats["kv_tier_disk_hits"] == 3 * len(second), stats
