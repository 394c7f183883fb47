"""MoE with DP attention through the CUDA-graph step's buffers, run on the CPU without
capture (engine.step.graphs): each replica decodes its own sequences, and every replica
steps at one bucket, agreed once a step (runner.agree), so the MoE layers' fixed-shape
exchange (comm/exchange.py) sees equal row counts; a replica with nothing to decode runs a
bucket of padding rows. transformers' tokens at DP2EP2 and DP4EP4, tiny Qwen3-MoE and tiny
DeepSeek-V3."""

import pytest
from graph_fns import eager_then_graphed
from reference import reference_tokens

from atoll import LLM, SamplingParams
from atoll.launch.local import run_local

# requests go to the replicas in turn; lengths differ, so replicas finish apart and idle
# replicas pad, and one replica's rows (bucket 2 at max_num_seqs=2) set the others' bucket
PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8], [250, 17], [8, 9], [60, 61, 62]]
MAX_TOKENS = [3, 8, 5, 2, 6, 4]


def _check(model_dir, layout):
    expected = [t[:n] for t, n in zip(reference_tokens(model_dir, PROMPTS, max(MAX_TOKENS)), MAX_TOKENS)]
    llm = LLM(model_dir, layout=layout, max_num_seqs=2, block_size=4)
    requests = llm.prepare(PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS])
    ranks = run_local(eager_then_graphed, llm.layout.world_size, llm.spec(requests), requests, timeout_s=400)
    first = ranks[0]  # the engine's rank 0 holds every replica's results
    assert first["eager"] == expected and first["graphed"] == expected
    steps = {r["steps"] for r in ranks}
    # the same count on every rank, though the replicas' decode work differs (a replica done
    # first pads); a tick where one replica prefills runs eager on all (it cannot take the step)
    assert len(steps) == 1 and steps.pop() >= max(MAX_TOKENS) // 2
    assert max(r["padded"] for r in ranks) > 0  # a replica with nothing to decode stepped on padding
    for r in ranks:
        assert r["kv_diff"] < 1e-4 and r["graphed"] == r["eager"]
        assert r["run"] == [1, 2]


@pytest.mark.timeout(450)
@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_dp2ep2_graph_buffers_give_transformers_tokens(tiny_model, kind):
    _check(tiny_model(kind), "DP2EP2")


@pytest.mark.timeout(600)
@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3"])
def test_dp4ep4_graph_buffers_give_transformers_tokens(tiny_model, kind):
    _check(tiny_model(kind), "DP4EP4")
