"""`atoll serve --elastic-ep` under the restart policy (serve.replica_start.start_single): the engine
goes on without a lost rank by itself, and when it cannot (its last rank lost) its ranks start
again at the whole layout, every request continuing there with its tokens: transformers' greedy
tokens in the end, one restart counted. A DP2EP2 tiny Qwen3-MoE with one redundant expert."""

import os
import signal
import threading
import time

import pytest
from reference import reference_cache

from atoll import LLM, SamplingParams
from atoll.engine.driver.elastic import ElasticEngine
from atoll.serve.replica_start import start_single
from atoll.serve.restarts import RestartPolicy

PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8], [17, 19]]
NEW = 40
FAMILIES = {"qwen3_moe": ("qwen3_moe", dict(num_experts=8))}


@pytest.fixture(scope="module")
def references(tiny_model):
    return reference_cache(tiny_model, FAMILIES, PROMPTS, NEW)


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_an_elastic_engine_that_lost_its_last_rank_starts_again_whole(references, monkeypatch):
    model_dir, expected = references("qwen3_moe")
    monkeypatch.setenv("ATOLL_COLLECTIVE_TIMEOUT_S", "20")
    llm = LLM(model_dir, layout="DP2EP2", enable_eplb=True, num_redundant_experts=1, eplb_step_interval=10_000,
              elastic_ep=True, max_model_len=96, fault_injection="delay:rank=0:ms=30")
    engine = start_single(llm, policy=RestartPolicy(backoff_s=0.0))
    try:
        first = engine.engines[0]
        assert isinstance(first, ElasticEngine)
        pids = list(first.job.pids)
        tokens = {i: [] for i in range(len(PROMPTS))}
        ends: dict = {}
        done = threading.Event()

        def sink_of(i):
            def sink(kind, payload):
                if kind == "token":
                    tokens[i].append(payload[0])
                else:
                    ends[i] = (kind, payload)
                    if len(ends) == len(PROMPTS):
                        done.set()
            return sink

        params = SamplingParams(max_tokens=NEW, ignore_eos=True)
        requests = llm.prepare([{"prompt_token_ids": p} for p in PROMPTS], params)
        engine.submit_all([(r, sink_of(i)) for i, r in enumerate(requests)])
        killed = []
        deadline = time.monotonic() + 300
        while not done.is_set() and time.monotonic() < deadline:
            least = min(len(t) for t in tokens.values())
            if not killed and least >= 8:
                killed.append(1)
                os.kill(pids[1], signal.SIGKILL)  # DP2EP2 goes on as one rank
            elif len(killed) == 1 and first.recoveries and least >= 16:
                killed.append(0)
                os.kill(pids[0], signal.SIGKILL)  # the last rank: the engine starts again whole
            time.sleep(0.01)
        assert done.is_set(), f"not every request ended: {len(ends)} of {len(PROMPTS)}"
        assert killed == [1, 0]
        assert [ends[i][0] for i in range(len(PROMPTS))] == ["finish"] * len(PROMPTS), ends
        assert [tokens[i] for i in range(len(PROMPTS))] == expected
        assert [(r["lost"], r["layout"]) for r in first.recoveries] == [([1], "TP1")]
        again = engine.engines[0]
        assert again is not first and isinstance(again, ElasticEngine) and str(again.layout) == "DP2EP2"
        assert engine.restarts.count(0) == 1 and not engine.degraded and engine.error is None
    finally:
        engine.close()
        llm.close()
