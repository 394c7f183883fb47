"""Elastic EP under the Ray launcher (--elastic-ep, engine/driver/elastic.py), on the simulated
cluster (conftest's `cluster`: two nodes of 2 CPUs on 127.0.0.1): a DP3EP3 tiny Qwen3-MoE with a
redundant expert, its ranks Ray actors 2 + 1 over the two nodes (unequal islands: the lone
rank's group is made too, parallel/mesh.py); rank 2's actor is killed by SIGKILL mid-generation
(--fault-injection kill). Ray names its death, the driver gives the actor up, the survivors
regroup through the driver's store as DP2EP2, and every request ends with transformers' greedy
tokens."""

import pytest
from launch_fns import die_on_rank, raise_on_rank
from reference import reference_cache

from atoll.engine.sample.sampler import SamplingParams

PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7], [64, 65, 66, 67], [3, 1, 4, 1, 5]]
NEW = 16


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_a_ray_actor_killed_mid_generation_leaves_dp2ep2_serving(cluster, tiny_model, monkeypatch):
    from atoll.launch.api import LLM, RayLauncher

    model_dir, expected = reference_cache(tiny_model, {"qwen3_moe": ("qwen3_moe", dict(num_experts=8))},
                                          PROMPTS, NEW)("qwen3_moe")
    monkeypatch.setenv("ATOLL_COLLECTIVE_TIMEOUT_S", "20")
    llm = LLM(model_dir, layout="DP3EP3", enable_eplb=True, num_redundant_experts=1, eplb_step_interval=10_000,
              elastic_ep=True, max_model_len=64, fault_injection="kill:rank=2:step=6", launcher=RayLauncher())
    try:
        engine = llm.start()
        nodes = [engine.job.node_of[r] for r in range(3)]
        assert nodes[0] == nodes[1] != nodes[2], nodes  # 2 + 1 ranks over the two nodes
        params = SamplingParams(max_tokens=NEW, ignore_eos=True)
        out = llm.generate_requests(llm.prepare([{"prompt_token_ids": p} for p in PROMPTS], params), timeout_s=300)
        assert [r["token_ids"] for r in out] == expected
        assert engine.healthy and str(engine.layout) == "DP2EP2"
        assert list(engine.degraded) == [2] and "died" in engine.degraded[2], engine.degraded
        (rec,) = engine.recoveries
        assert rec["lost"] == [2] and rec["from_checkpoint"] == 2 * 3, rec  # rank 2's experts 6 and 7, 3 layers
        print(f"Ray: regrouped {rec['rebuilt_s']:.2f} s after the collective failed; serving again "
              f"{rec['recovery_s']:.2f} s after the driver heard")
    finally:
        llm.close()


def test_a_ray_actors_death_counts_as_a_lost_rank_and_its_own_error_does_not():
    """RankFailure.died, set by the launcher that saw the failure: what --elastic-ep goes on without."""
    ray = pytest.importorskip("ray")
    from atoll.launch.ray_launcher import _death_cause, _ray_failure

    text = ("The actor died unexpectedly before finishing this task. class_name: _RankActor pid: 4242 "
            "The actor is dead because its worker process has died. Worker exit type: SYSTEM_ERROR "
            "Worker exit detail: Worker unexpectedly exits with a connection error code 2. End of file.")
    assert _death_cause(text).startswith("actor (pid 4242) died")
    assert _ray_failure(ray, ray.exceptions.ActorDiedError(), 2, {}).died
    own = ray.exceptions.RayTaskError("run", "Traceback: ...", ValueError("an expert without a source"))
    assert not _ray_failure(ray, own, 2, {}).died
    unborn = ray.exceptions.ActorDiedError(cause=ray.exceptions.RayTaskError("__init__", "Traceback: ...",
                                                                            ImportError("no module named x")))
    assert not _ray_failure(ray, unborn, 2, {}).died  # its creation task failed: it never ran


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fn, died", [(die_on_rank, True), (raise_on_rank, False)])
def test_the_local_launcher_says_whether_a_rank_died_or_raised(tmp_path, fn, died):
    from atoll.errors import RankFailure
    from atoll.launch.local import LocalJob

    job = LocalJob(fn, 2, 1, str(tmp_path))
    try:
        with pytest.raises(RankFailure) as e:
            job.wait(timeout_s=90)
    finally:
        job.stop()
    assert e.value.rank == 1 and e.value.died is died, e.value
