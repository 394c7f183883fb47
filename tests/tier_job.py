"""Run under torchrun or mpirun by tests/engine/kv/test_tier_launchers.py: every process is one
rank of a living engine with KV cache tiers; rank 0 is also its driver (launch.rank_job), and
serves the prompts one at a time, as `atoll serve` under those launchers does. Rank 0 writes
OUT (JSON): each prompt's tokens and cached_tokens, and the engine's stats after the last one.

    torchrun --nproc-per-node 2 tests/tier_job.py torchrun JOB.json OUT.json
    mpirun -np 2 ... python tests/tier_job.py mpi JOB.json OUT.json

JOB.json: {"model": DIR, "layout": "TP2", "prompts": [[ids]], "new": N, "engine": {LLM keywords}}.
"""

import json
import sys
from pathlib import Path

from atoll import LLM, SamplingParams
from atoll.engine.worker import worker
from atoll.launch.api import RankLauncher
from atoll.launch.leave import leave_job
from atoll.parallel.layout import Layout


def main() -> int:
    name, job, out = sys.argv[1], json.loads(Path(sys.argv[2]).read_text()), Path(sys.argv[3])
    launcher = RankLauncher(name)
    if not launcher.first:  # serve until rank 0's driver says stop
        launcher.join(worker, Layout.parse(job["layout"]).world_size, None, None, None, device="cpu")
        return 0
    params = SamplingParams(max_tokens=job["new"], ignore_eos=True)
    llm = LLM(job["model"], launcher=launcher, layout=job["layout"], **job["engine"])
    try:
        outs = [llm.generate([p], params)[0] for p in job["prompts"]]
        stats = dict(llm.start().stats)
    finally:
        llm.close()
    out.write_text(json.dumps({"token_ids": [o.token_ids for o in outs],
                               "cached_tokens": [o.metrics["cached_tokens"] for o in outs],
                               "errors": [o.error for o in outs], "stats": stats}))
    return 0


if __name__ == "__main__":
    leave_job(main())  # a torchrun/mpirun rank leaves at once (launch/leave.py)
