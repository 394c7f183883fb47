"""fp8 weights kept in fp8 (`--quantization fp8`: layers/fp8_linear.py, kernels/fp8.py): the
block-fp8 Triton GEMM against its torch reference in Triton's interpreter, and a tiny
DeepSeek-V3 fp8 checkpoint run at TP2 and EP2 against transformers on its dequantized
weights, with each rank's fp8 bytes beside what bf16 would take.

The tiny DeepSeek-V3 has every shard's columns on a 128 boundary at TP2 and EP2 (hidden 256,
MLA's o_proj 4 heads x 64 = 256 columns, dense and expert intermediate 256), so every linear
but kv_b_proj and every expert stays fp8; its 64-row shards and [gate; up] merges start
inside 128-row blocks. On the CPU the products dequantize the weights as stored, so the run
equals the dequantized model to float32 rounding (perplexity to 1e-4, same top-1)."""

import math

import pytest
import torch

from fp8_quant import write_fp8_pair
from quant_fns import weight_report
from test_kernels import triton_path  # noqa: F401  (fixture)

from atoll import LLM
from atoll.errors import InputError
from atoll.kernels import fp8
from atoll.kernels.backend import KernelError


@pytest.mark.parametrize("m,n,k", [(1, 64, 128), (5, 130, 256), (33, 96, 200)])
@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
def test_triton_gemm_is_its_reference(triton_path, m, n, k, out_dtype):
    g = torch.Generator().manual_seed(m * n)
    x, w = torch.randn(m, k, generator=g).to(out_dtype), torch.randn(n, k, generator=g) * 0.1
    wq, ws = fp8.quantize_weight(w)
    a, a_s = fp8.quantize_activations(x)
    want = fp8.gemm_reference(a, a_s, wq, ws, out_dtype)
    got = fp8.fp8_linear(x, wq, ws)  # the dispatcher, on the Triton path
    assert got.dtype == out_dtype and got.shape == (m, n)
    tol = 1e-5 if out_dtype == torch.float32 else 2**-6  # bf16: the interpreter rounds by truncation
    assert (got.float() - want.float()).abs().max() <= tol * want.float().abs().max()
    # fp8 activations and weights: within e4m3's relative 2**-4 of each operand of the float product
    exact = x.float() @ w.T
    assert (got.float() - exact).abs().max() <= 0.15 * exact.abs().max()


def test_weight_groups_round_within_e4m3():
    w = torch.randn(40, 300) * torch.logspace(-2, 2, 40)[:, None]
    q, s = fp8.quantize_weight(w)
    assert q.dtype == torch.float8_e4m3fn and s.shape == (40, 3)
    back = fp8.dequantize_weight(q, s)
    step = s.repeat_interleave(128, 1)[:, :300]  # one fp8 unit at the group's scale
    assert ((back - w).abs() <= torch.maximum(w.abs() * 2**-4, step * 2**-9)).all()


def test_cpu_path_multiplies_by_the_dequantized_weight():
    x, w = torch.randn(3, 256), torch.randn(50, 256)
    q, s = fp8.quantize_weight(w)
    got = fp8.fp8_linear(x, q, s)
    assert torch.allclose(got, x @ fp8.dequantize_weight(q, s).T, rtol=1e-5, atol=1e-5)
    with pytest.raises(KernelError, match="scale has shape"):
        fp8.fp8_linear(x, q, s[:, :1])


DSV3 = dict(hidden_size=256, intermediate_size=256, moe_intermediate_size=256, v_head_dim=64, num_hidden_layers=2,
            first_k_dense_replace=1, n_routed_experts=4, n_group=2, topk_group=1, num_experts_per_tok=2,
            n_shared_experts=1)


@pytest.fixture(scope="module")
def dsv3_fp8(tiny_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("fp8-kept")
    return write_fp8_pair(tiny_model("deepseek_v3", **DSV3), root / "fp8", root / "ref")


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["TP2", "EP2"])
def test_dsv3_fp8_checkpoint_kept_in_fp8(dsv3_fp8, layout):
    from transformers import AutoModelForCausalLM

    from atoll.engine.driver.perplexity import run_scores, windows

    fp8_dir, ref_dir = dsv3_fp8
    ids = torch.randint(0, 301, (100,), generator=torch.Generator().manual_seed(0)).tolist()
    wins = windows(ids, 24, 96)
    model = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor(wins)).logits.double()
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(2, torch.tensor(wins)[:, 1:, None])
    with LLM(fp8_dir, layout=layout, quantization="fp8", max_num_seqs=4) as llm:
        scores = run_scores(llm, wins)
        kept = llm.run(weight_report, llm.layout.world_size, llm.spec(), parallel=llm.context_options())
    with LLM(fp8_dir, layout=layout, dtype="bfloat16") as llm:  # the same checkpoint dequantized to bf16
        bf16 = llm.run(weight_report, llm.layout.world_size, llm.spec(), parallel=llm.context_options())
    assert scores.perplexity == pytest.approx(math.exp(nll.mean().item()), rel=1e-4)
    assert scores.top1 == logits[:, :-1].argmax(-1).tolist()
    for k, b in zip(kept, bf16):
        names = k["fp8_names"]
        assert any("experts.w13" in n for n in names) and any("o_proj" in n for n in names), names
        assert not any("kv_b_proj" in n or "lm_head" in n or "embed" in n for n in names), names
        assert k["fp8_bytes"] == k["fp8_elements"]  # 1 byte each: half of bf16's 2
        # scales: 4 bytes per row and 128 columns, at most 4/128 of the fp8 bytes here (a 64-column kv_a row: 4/64)
        assert k["scale_bytes"] <= k["fp8_bytes"] * 4 / 64
        # the same parameters in bf16 take twice the fp8 bytes
        assert sum(b["param_bytes"][n] for n in names) == 2 * k["fp8_bytes"]


@pytest.mark.timeout(300)
def test_online_fp8_llama_and_the_planner_agree(tiny_model):
    """A float checkpoint quantized as read (--quantization fp8) at TP2: the column-parallel
    linears in fp8 on each rank, the ranks' bytes equal to `atoll plan --quantization fp8`'s,
    and the tokens within fp8's error of transformers' (measured 49 of 64 before the first
    difference, 48 at TP1: at least 44)."""
    from test_int8_weights import PROMPTS, _prefix, planner_weight_bytes
    from reference import reference_tokens

    from atoll import SamplingParams

    model_dir = tiny_model("llama")
    with LLM(model_dir, layout="TP2", quantization="fp8") as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=16, ignore_eos=True))
        reports = llm.run(weight_report, 2, llm.spec(), parallel=llm.context_options())
    # qkv and gate/up of 3 layers; o_proj and down_proj shards (32 and 64 columns) stay float
    assert all(len(r["fp8_names"]) == 3 * 2 and r["fp8_bytes"] > 0 for r in reports), reports
    assert planner_weight_bytes(model_dir, "TP2", "fp8") == max(r["bytes"] for r in reports)
    expected = reference_tokens(model_dir, PROMPTS, 16)
    assert sum(_prefix(o.token_ids, e) for o, e in zip(outs, expected)) >= 44


def test_refusals():
    from atoll.models import quantize

    class Config:
        raw = {"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 64]}}

    with pytest.raises(InputError, match="--quantization fp8 keeps 128-column scale blocks"):
        quantize.check("fp8", Config(), "cpu")
