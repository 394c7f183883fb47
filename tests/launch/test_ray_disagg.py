"""Disaggregated prefill/decode under the Ray launcher, on the simulated cluster (conftest's
`cluster`: two nodes of 2 CPUs and 2 fake GPUs on 127.0.0.1): a TP2 prefill engine and a TP2
decode engine, one living job whose two TP pairs each share a node, the two on different
nodes, so the KV transfer crosses nodes; greedy tokens equal transformers', long prompts
prefilled remotely, and closing the job gives every GPU back."""

import pytest
from launch_fns import free_gpus_back
from reference import reference_tokens

SHORT = [[5, 7, 9], [42]]
LONG = [list(range(20, 60)), list(range(100, 148))]
NEW = 6
LONG_NEW = 120  # tokens a request of the kill test decodes: long enough to be killed in flight


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_tp2_prefill_to_tp2_decode_across_two_ray_nodes(cluster, tiny_model):
    from atoll.engine.sample.sampler import SamplingParams
    from atoll.launch.api import LLM, RayLauncher

    model = tiny_model("llama", num_hidden_layers=4)
    llm = LLM(model, prefill="TP2", decode="TP2", disagg_min_prompt_tokens=16, launcher=RayLauncher(tp_size=2))
    try:
        assert llm.living  # both engines stay up between calls, as with the local launcher
        prompts = SHORT + LONG
        outs = llm.generate(prompts, SamplingParams(max_tokens=NEW, ignore_eos=True))
        assert [o.token_ids for o in outs] == reference_tokens(model, prompts, NEW)
        where = [o.metrics["prefilled_on"] for o in outs]
        assert where == ["decode", "decode", "prefill", "prefill"], where
        assert all(o.metrics["kv_bytes_sent"] > 0 for o in outs[2:])
        nodes = llm._engine.job.node_of
        prefill_nodes, decode_nodes = {nodes[0], nodes[1]}, {nodes[2], nodes[3]}
        assert len(prefill_nodes) == len(decode_nodes) == 1 and prefill_nodes != decode_nodes, nodes
        again = llm.generate(LONG[:1], SamplingParams(max_tokens=NEW, ignore_eos=True))  # the same job serves on
        assert again[0].token_ids == outs[2].token_ids
    finally:
        llm.close()
    assert free_gpus_back() == 4


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_a_dead_decode_engine_under_ray_leaves_the_others_serving(cluster, tiny_model):
    """1P2D under Ray: decode engine 1's actor is killed while both decode engines hold requests.
    The driver ends that engine alone (RayJob.give_up) and /health's `degraded` names it; the
    requests it held move to decode engine 0, with the tokens they had; every request ends
    with transformers' tokens, and the next requests run on decode engine 0."""
    import threading
    import time

    import ray

    from atoll.engine.sample.sampler import SamplingParams
    from atoll.launch.api import LLM, RayLauncher

    model = tiny_model("llama", num_hidden_layers=4)
    llm = LLM(model, prefill="TP1", decode="TP1", decode_replicas=2, disagg_min_prompt_tokens=16,
              max_num_seqs=1, launcher=RayLauncher())  # one sequence at a time: the rest queue
    prompts = (SHORT + LONG) * 2
    long_run = SamplingParams(max_tokens=LONG_NEW, ignore_eos=True)
    want = reference_tokens(model, prompts, LONG_NEW)
    try:
        engine = llm.start()
        outs = []
        run = threading.Thread(target=lambda: outs.extend(llm.generate(prompts, long_run, timeout_s=240)))
        run.start()
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not all(engine._engine_stats.get(f"decode engine {j}", {}).get(
                "running") for j in (0, 1)):
            time.sleep(0.05)  # both decode engines are decoding
        assert run.is_alive(), "the run ended before the kill; make it longer"
        ray.kill(engine.job._ranked[2], no_restart=True)  # job ranks: prefill, decode 0, decode 1
        run.join(timeout=240)
        assert not run.is_alive() and len(outs) == len(prompts)
        assert list(engine.degraded) == ["decode engine 1"] and engine.error is None, engine.degraded
        assert [o.error for o in outs] == [None] * len(outs)
        assert any(o.metrics.get("migrations") for o in outs)  # decode engine 1's moved on
        for o, w in zip(outs, want):  # the survivors, and those moved, end with transformers' tokens
            assert o.token_ids == w and o.finish_reason == "length", (o.id, o.token_ids, w)
        params = SamplingParams(max_tokens=NEW, ignore_eos=True)
        assert [o.token_ids for o in llm.generate(SHORT + LONG, params)] == reference_tokens(model, SHORT + LONG, NEW)
        assert llm._engine is engine  # the same job serves on
    finally:
        llm.close()
    assert free_gpus_back() == 4
