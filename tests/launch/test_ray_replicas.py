"""Serving replicas under the Ray launcher, on a simulated cluster (conftest's `cluster`: two
nodes of 2 CPUs and 2 fake GPUs on 127.0.0.1): two TP2 replicas, each a Ray job whose TP pair
shares a node, the two on different nodes, behind the cache-aware router; greedy tokens equal
transformers', and closing them gives every GPU back."""

import threading
from dataclasses import replace

import pytest
from launch_fns import free_gpus_back
from reference import reference_tokens

PROMPTS = [[5, 7, 9], [100, 3], [42], list(range(20, 60))]
NEW = 6


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_two_tp2_replicas_one_per_ray_node(cluster, tiny_model):
    from atoll.engine.sample.sampler import SamplingParams
    from atoll.launch.api import LLM, RayLauncher
    from atoll.serve.replica_start import start_replicas

    model = tiny_model("llama", num_hidden_layers=4)
    llm = LLM(model, layout="TP2", launcher=RayLauncher(tp_size=2))
    replicas = start_replicas(llm, 2)
    try:
        nodes = [sorted(set(e.job.node_of.values())) for e in replicas.engines]
        assert all(len(n) == 1 for n in nodes) and nodes[0] != nodes[1], nodes
        tokens: dict[int, list] = {k: [] for k in range(len(PROMPTS))}
        ended: dict[int, str] = {}
        done = threading.Event()

        def sink(k):
            def take(kind, payload):  # the replica's pump thread
                if kind == "token":
                    tokens[k].append(payload[0])
                    return
                ended[k] = payload if kind == "error" else payload["finish_reason"]
                if len(ended) == len(PROMPTS):
                    done.set()
            return take

        requests = llm.prepare(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
        for k, r in enumerate(requests):
            replicas.submit(replace(r, index=replicas.new_id()), sink(k))
        assert done.wait(120), (tokens, ended)
        assert ended == {k: "length" for k in range(len(PROMPTS))}
        assert [tokens[k] for k in range(len(PROMPTS))] == reference_tokens(model, PROMPTS, NEW)
        assert replicas.degraded == {}
    finally:
        replicas.close()
    assert free_gpus_back() == 4
