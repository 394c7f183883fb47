"""Elastic EP's regroup with real processes (gloo on 127.0.0.1): three ranks of an ep group
holding expert slots by a Placement step collectives until `--fault-injection kill` strikes
one; the survivors notice within the group timeout, rejoin over the driver's store without it
(EP3 -> EP2), and the experts that had no copy left are loaded from the checkpoint. A second
case has no checkpoint source: one line naming the expert."""

import multiprocessing
import time

import pytest
import torch

from atoll.comm import regroup
from atoll.comm.eplb import Placement
from elastic_fns import rank_main

TIMEOUT_S = 10.0  # the group's collective timeout: detection of a hung peer, and each wait here
WORLD = 3


def run_job(tmp_path, placement, loadable, victim=2, fault="kill", timeout_s=TIMEOUT_S):
    """Three ranks; `fault` strikes `victim` at step 5. The driver ends the victim (a killed one
    has ended) once its process ended or a survivor noticed, then announces the other two."""
    weights = torch.randn(placement.num_logical, 8, generator=torch.Generator().manual_seed(0))
    ckpt = tmp_path / "experts.pt"
    torch.save(weights, ckpt)
    store = regroup.serve_store()
    mp = multiprocessing.get_context("spawn")
    results = mp.Queue()
    procs = [mp.Process(target=rank_main, args=(r, WORLD, store.port, placement, f"{fault}:rank={victim}:step=5",
                                                str(ckpt), loadable, timeout_s, results), daemon=True)
             for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        others = [r for r in range(WORLD) if r != victim]
        deadline = time.monotonic() + 120
        while procs[victim].is_alive() and not regroup.failed(store, 0, others):
            assert time.monotonic() < deadline, "nothing noticed the fault"
            time.sleep(0.01)
        procs[victim].kill()  # a silent rank is ended by its pid; a killed one has ended
        procs[victim].join(timeout=10)
        assert procs[victim].exitcode == -9
        regroup.announce(store, 1, [r for r in range(WORLD) if r != victim])
        out = dict(results.get(timeout=60) for _ in range(WORLD - 1))
        for p in procs:
            p.join(timeout=30)
        return weights, out
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


def test_survivors_rejoin_and_load_the_orphaned_experts(tmp_path):
    # 8 experts + 1 spare over EP3: rank 2 holds 6 and 7 and a copy of 0, which survives on rank 0
    placement = Placement.initial(8, 1, 3)  # [0,1,2] [3,4,5] [6,7,0]
    weights, out = run_job(tmp_path, placement, loadable={6, 7})
    assert set(out) == {0, 1}, out
    for rank, res in out.items():
        assert isinstance(res, dict), res
        assert res["new_rank"] == rank and res["world"] == 2 and res["steps"] >= 5
        # each slot of the gathered survivors holds its expert's checkpoint weights
        assert sorted(set(res["phy2log"])) == list(range(8))
        torch.testing.assert_close(torch.tensor(res["gathered"]), weights[res["phy2log"]], rtol=0, atol=0)
        assert res["rejoin_s"] < TIMEOUT_S * 2
        assert res["waited_s"] < 1.0  # a dead peer fails gloo's collective at once, not at the timeout
    assert sorted(out[0]["loaded"] + out[1]["loaded"]) == [6, 7]
    print(f"kill: the collective raised after {max(r['waited_s'] for r in out.values()):.2f}s; "
          f"failure to rejoined {max(r['rejoin_s'] for r in out.values()):.2f}s")


def test_a_silent_rank_is_noticed_within_the_group_timeout(tmp_path):
    # `drop`: the victim lives on but sends nothing; the survivors' collective times out
    placement = Placement.initial(4, 2, 3)  # [0,1] [2,3] [0,1]: rank 1's 2 and 3 are loaded again
    timeout_s = 2.0
    weights, out = run_job(tmp_path, placement, loadable={2, 3}, fault="drop", timeout_s=timeout_s)
    for res in out.values():
        assert isinstance(res, dict), res
        torch.testing.assert_close(torch.tensor(res["gathered"]), weights[res["phy2log"]], rtol=0, atol=0)
    waited = [r["waited_s"] for r in out.values()]
    # the collective that hung raised after about timeout_s, not gloo's default of minutes
    assert all(timeout_s * 0.9 < w < timeout_s + 3 for w in waited), waited
    print(f"drop: the hung collective raised after {max(waited):.2f}s (timeout {timeout_s}s); "
          f"failure to rejoined {max(r['rejoin_s'] for r in out.values()):.2f}s")


def test_an_expert_without_source_fails_naming_it(tmp_path):
    placement = Placement.initial(8, 1, 3)  # rank 2 alone holds 6 and 7
    _, out = run_job(tmp_path, placement, loadable={6})
    for res in out.values():
        assert res.startswith("ExpertLost: expert 7 of MoE layer 0 has no source") and "\n" not in res
