"""Elastic EP in a running engine (launch/elastic.py, engine/rank/elastic_run.py): a DP3EP3
engine of CPU ranks with redundant experts on a tiny Qwen3-MoE loses rank 2 mid-generation to
`--fault-injection kill`; the survivors rebuild their groups and go on as DP2EP2, the lost
rank's requests go on from their tokens, and every request ends with transformers' greedy
tokens. DP3EP3 rather than DP4EP4: four ranks of this test on a 2-core machine are too slow."""

import pytest
from reference import reference_cache

from atoll import SamplingParams
from atoll.engine.batch.request import Request
from atoll.engine.rank.run_spec import RunSpec
from atoll.launch.elastic import run_elastic

PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8], [9, 8, 7], [64, 65, 66, 67], [3, 1, 4, 1, 5]]
NEW = 16
FAMILIES = {"qwen3_moe": ("qwen3_moe", dict(num_experts=8))}


@pytest.fixture(scope="module")
def references(tiny_model):
    return reference_cache(tiny_model, FAMILIES, PROMPTS, NEW)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_dp3ep3_loses_a_rank_and_finishes_as_dp2ep2_with_transformers_tokens(references):
    model_dir, expected = references("qwen3_moe")
    # 8 experts + 1 spare over EP3: [0, 1, 2] [3, 4, 5] [6, 7, 0]; rank 2's 6 and 7 have no copy left
    spec = RunSpec.of(model_dir, "DP3EP3", max_model_len=64, enable_eplb=True, num_redundant_experts=1,
                      eplb_step_interval=10_000, fault_injection="kill:rank=2:step=6")
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    requests = [Request(i, p, params) for i, p in enumerate(PROMPTS)]
    out = run_elastic(spec, requests, 3, timeout_s=10.0, wait_s=240, threads=1)
    assert out["lost"] == [2] and out["layouts"] == ["DP3EP3", "DP2EP2"]
    (rec,) = out["recoveries"]
    assert rec["lost"] == [2] and rec["from_checkpoint"] == 2 * 3  # experts 6 and 7 of each of the 3 MoE layers
    assert [r["token_ids"] for r in out["results"]] == expected
    # the lost rank's requests (2 and 5: DP replica 2) had tokens before the loss and went on from them
    assert rec["noticed_s"] < 10.0
    print(f"DP3EP3 -> DP2EP2: noticed {rec['noticed_s']:.2f}s after the failure, serving again "
          f"{rec['rebuilt_s']:.2f}s after it ({rec['cause']})")
