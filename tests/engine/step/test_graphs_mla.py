"""DeepSeek-V3's decode step (MLA: the absorbed decode over the latent cache) through the
CUDA-graph step's static buffers, run on the CPU without capture (engine.step.graphs): the
bucket choice, padding rows and fixed-width tables give transformers' tokens at TP1 and TP2,
with plain, int8 and fp8 latent caches (a quantized cache: the eager step's tokens over the same
cache, since quantization moves the logits), and MTP's verify steps at buckets of their own.
The capture itself needs a GPU (examples/gpu_check.sh)."""

from types import SimpleNamespace

import pytest
import torch
from graph_fns import eager_then_graphed
from mtp_fns import with_mtp_layer
from reference import reference_tokens

from atoll import LLM, SamplingParams
from atoll.engine.step import policy as step_policy
from atoll.engine.step.graphs import GraphedDecode
from atoll.launch.local import run_local

# max_num_seqs=4: buckets 1, 2, 4; decode batches of 4, 3 (bucket 4, one padding row), then 1
PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8], [250, 17]]
MAX_TOKENS = [3, 6, 6, 10]


@pytest.fixture(scope="module")
def deepseek(tiny_model):
    """(tiny DeepSeek-V3 dir: 3 layers, the first dense, q low-rank; transformers' tokens)."""
    model_dir = tiny_model("deepseek_v3")
    expected = [t[:n] for t, n in zip(reference_tokens(model_dir, PROMPTS, max(MAX_TOKENS)), MAX_TOKENS)]
    return model_dir, expected


@pytest.fixture(scope="module")
def with_mtp(tiny_model, tmp_path_factory):
    """(tiny DeepSeek-V3 with an MTP layer, prompts whose repeats let some drafts pass, transformers' tokens)."""
    model_dir = with_mtp_layer(tiny_model("deepseek_v3"), tmp_path_factory.mktemp("tiny-deepseek-mtp"))
    prompts = [[5, 5, 5], [7] * 8, [42, 1, 2, 3, 4, 5, 6, 7, 8]]
    return model_dir, prompts, reference_tokens(model_dir, prompts, 12)


def _ranks(model_dir, layout, **options):
    llm = LLM(model_dir, layout=layout, max_num_seqs=4, block_size=4, **options)
    requests = llm.prepare(PROMPTS, [SamplingParams(max_tokens=n, ignore_eos=True) for n in MAX_TOKENS])
    return run_local(eager_then_graphed, llm.layout.world_size, llm.spec(requests), requests, timeout_s=200)


@pytest.mark.timeout(250)
@pytest.mark.parametrize("layout,kv", [("TP1", "auto"), ("TP2", "auto"), ("TP1", "int8"), ("TP1", "fp8_e4m3"),
                                       ("TP2", "fp8_e5m2")])
def test_mla_graph_buffers_give_transformers_tokens(deepseek, layout, kv):
    model_dir, expected = deepseek
    for r in _ranks(model_dir, layout, kv_cache_dtype=kv):
        if kv == "auto":
            assert r["eager"] == expected
        assert r["graphed"] == r["eager"]
        assert r["kv_diff"] < 1e-4  # padding rows wrote only the scratch block
        # every decode tick through the buffers: 2 of 4 rows, 3 of 3 (bucket 4), then 4 of 1
        assert r["run"] == [1, 4] and r["steps"] == max(MAX_TOKENS) - 1


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["TP1", "TP2"])
def test_mtp_verify_steps_run_through_the_graph_buffers(with_mtp, layout):
    """MTP (K=2) verify steps, a row per position, at buckets up to max_num_seqs x 3 rows:
    transformers' tokens, drafts both kept and rejected."""
    model_dir, prompts, expected = with_mtp
    llm = LLM(model_dir, layout=layout, max_num_seqs=3, block_size=4,
              speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 2})
    requests = llm.prepare(prompts, SamplingParams(max_tokens=12, ignore_eos=True))
    for r in run_local(eager_then_graphed, llm.layout.world_size, llm.spec(requests), requests, timeout_s=250):
        assert r["eager"] == expected and r["graphed"] == expected
        assert 0 < r["accepted"] < r["drafted"]
        assert r["buckets"][-1] == 9 and max(r["run"]) > 3  # more rows than sequences: verify steps
        assert r["steps"] > 0


def _runner(device: str, *, mla: bool, moe: bool, dp: int):
    """What engine.step.policy.build reads of a runner: a one-parameter model on the CPU (a
    GraphedDecode builds nothing on its device before its first step)."""
    model = torch.nn.Linear(2, 2)
    model.ctx = SimpleNamespace(is_first_stage=True, is_last_stage=True)
    engine = SimpleNamespace(enforce_eager=False, compile="auto", max_num_seqs=4, block_size=4, quantization=None)
    return SimpleNamespace(spec=SimpleNamespace(engine=engine, max_model_len=32), spec_k=None, num_blocks=8,
                           config=SimpleNamespace(is_mla=mla, is_moe=moe), model=model, cache=None,
                           ctx=SimpleNamespace(rank=0, layout=SimpleNamespace(dp=dp)), device=torch.device(device))


@pytest.mark.parametrize("mla,moe,dp", [(True, True, 1), (False, True, 2), (True, True, 4)])
def test_policy_graphs_mla_and_dp_moe_on_cuda(mla, moe, dp):
    """On CUDA the policy captures MLA and MoE with DP (both decoded eagerly before); on the
    CPU they stay eager (the inductor graphs are made for the dense layers)."""
    assert isinstance(step_policy.build(_runner("cuda", mla=mla, moe=moe, dp=dp)), GraphedDecode)
    assert step_policy.build(_runner("cpu", mla=mla, moe=moe, dp=dp)) is None
    runner = _runner("cuda", mla=mla, moe=moe, dp=dp)
    runner.spec.engine.enforce_eager = True
    assert step_policy.build(runner) is None
