"""The quantized KV cache (--kv-cache-dtype, layers/kv_quant.py): round-trip error bounds, bytes
per token shared by the planner and the runtime, the Triton decode kernel reading the quantized
cache in Triton's interpreter, greedy tokens on tiny models against transformers', and
`atoll eval perplexity` against transformers' exp(mean NLL). The fp8 scales themselves (fits,
files, checkpoints, calibrate-kv) are tests/layers/test_kv_scales.py's.

The greedy rule: the tiny models (std 0.1 weights, vocab 301) are chaotic once a token
differs, so the count is the tokens before each sequence's first difference from
transformers' greedy tokens. int8 (per token-head scale, error <= amax/254) keeps at least
60 of 64 (measured when this was written: llama TP1 63, TP2 63; deepseek_v3 TP1 64). fp8 e4m3
(3 mantissa bits, relative error <= 1/16) parts from them within a few dozen tokens, so it is
checked teacher-forced instead, where one difference does not carry on: every position of
text windows scored through the quantized cache (`atoll eval perplexity`'s path) against
transformers' float model. The bounds are what the cache gives, with a margin of a few
positions (the random tiny models have no attention sink for fp8's sink to keep, so scales
calibrated on other random tokens move them little; SmolLM2's figures are in
docs/quantization.md): measured llama fp8 -0.24% and 88.1% of the top tokens, fp8 with
calibrated scales -0.05% and 88.5%; deepseek_v3 (MLA: a scale, no sink) fp8 -1.1% and 95.6%;
int8 within 0.14% and 97%; checked: fp8 within 0.5% and 86% (MLA 1.5% and 94%), int8 0.5%
and 93%. fp8's greedy tokens (16 of 4 prompts) keep 35 of 64 (llama TP1 and TP2) and 33
(deepseek_v3) before the first difference: checked at 30."""

import math

import pytest
import torch

from reference import reference_tokens
from test_kernels import DEVICE, triton_path  # noqa: F401  (triton_path: fixture)
from test_kv_scales import fit_scales
from test_paged_attention import paged_batch, padded

from atoll import LLM, SamplingParams
from atoll.cli.eval import _common_prefix  # tokens before the first difference
from atoll.errors import InputError
from atoll.kernels import ops, reference
from atoll.layers.attention import AttentionMetadata, attend
from atoll.layers.kv_quant import FORMATS, QuantizedKV, dequantize, kv_format, quantize

PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8], [250]]
NEW = 16


# --- quantize / dequantize ---

def test_int8_round_trip_within_half_a_step_per_token_head():
    x = torch.randn(64, 4, 96) * torch.logspace(-3, 2, 64)[:, None, None]  # magnitudes 1e-3..1e2 by token
    q, scale = quantize(x, FORMATS["int8"])
    assert q.dtype == torch.int8 and scale.shape == (64, 4) and scale.dtype == torch.float32
    err = (dequantize(q, scale, torch.float32) - x).abs()
    bound = x.abs().amax(-1, keepdim=True) / 254  # half of one step, amax / 127
    assert (err <= bound * (1 + 1e-5)).all()
    assert q.abs().amax(-1).eq(127).all()  # each token-head's largest value uses the whole range


@pytest.mark.parametrize("name,rel", [("fp8_e4m3", 2**-4), ("fp8_e5m2", 2**-3)])
def test_fp8_round_trip_relative_error(name, rel):
    fmt = kv_format(name)
    assert kv_format("fp8" if name == "fp8_e4m3" else name) == fmt and fmt.scale_bytes == 0
    x = torch.randn(4096) * 10
    x = x[x.abs() > 2**-6]  # normal numbers (smaller ones are subnormal: an absolute 2**-9 or so)
    q, scale = quantize(x, fmt)
    assert scale is None and q.dtype == fmt.storage
    assert ((dequantize(q, None, torch.float32) - x).abs() <= rel * x.abs()).all()
    top = torch.finfo(fmt.storage).max
    big = torch.tensor([2 * top, -2 * top])
    assert dequantize(quantize(big, fmt)[0], None, torch.float32).tolist() == [top, -top]  # clamped, not inf


# --- bytes per token: planner == runtime ---

@pytest.mark.parametrize("kind,tp", [("llama", 1), ("llama", 2), ("deepseek_v3", 1)], ids=["gqa-tp1", "gqa-tp2", "mla"])
def test_planner_counts_the_runtime_cache_bytes(tiny_model, kind, tp):
    from atoll.engine.kv.sizing import explicit_blocks, static_scale_bytes
    from atoll.planner.memory import memory_fit
    from atoll.topologies import load_topology
    from atoll.models import ModelConfig
    from atoll.engine.kv.sizing import kv_bytes_per_block
    from atoll.engine.rank.kv_cache import make_cache
    from atoll.parallel.layout import Layout
    from atoll.planner.shapes import shapes
    from atoll.planner.workload import Workload

    config = ModelConfig.load(tiny_model(kind))
    layers, per_token, blocks = config.num_hidden_layers, {}, {}
    for planner_name, kv in (("bf16", "auto"), ("fp8", "fp8"), ("fp8_e5m2", "fp8_e5m2"), ("int8", "int8")):
        cache = make_cache(config, tp, layers=layers, blocks=3, block_size=16, dtype=torch.bfloat16, device="cpu",
                           kv_cache_dtype=kv)
        w = Workload(kv_dtype=planner_name)
        planned = shapes(config).kv_bytes_per_token_layer(tp, w.kv_bytes, w.kv_scale_bytes) * layers
        assert planned == cache.bytes_per_token, planner_name
        per_block = kv_bytes_per_block(config, Layout.parse(f"TP{tp}"), 2, 16, kv_cache_dtype=kv)
        assert per_block == cache.bytes_per_token * 16
        per_token[kv] = cache.bytes_per_token
        blocks[kv] = explicit_blocks(bytes_per_block=per_block, kv_cache_gb=1.0, num_blocks=None)
    assert per_token["fp8"] * 2 == per_token["auto"]  # unscaled: exactly half of bf16
    dim = config.kv_lora_rank + config.qk_rope_head_dim if config.is_mla else config.head_dim
    assert per_token["int8"] * 2 * dim == per_token["auto"] * (dim + 4)  # + a float32 scale per head
    # the same --kv-cache-gb: 2x the blocks in fp8, 2 dim / (dim + 4) x in int8 (1.6x at the tiny
    # models' head_dim 16; 1.88x at 64, 1.94x at 128, 1.99x for DeepSeek-V3's 576 latent)
    assert blocks["fp8"] == pytest.approx(2 * blocks["auto"], abs=1)
    assert blocks["int8"] == pytest.approx(blocks["auto"] * 2 * dim / (dim + 4), rel=1e-5)
    # fp8 e4m3's fixed scales and sinks: a few bytes per layer, charged by the planner's fit
    fits = {}
    for kv in ("fp8", "fp8_e5m2"):
        cache = make_cache(config, tp, layers=layers, blocks=3, block_size=16, dtype=torch.bfloat16, device="cpu",
                           kv_cache_dtype=kv)
        assert static_scale_bytes(config, tp, layers, kv) == cache.static_bytes
        w = Workload(kv_dtype=kv, concurrency=1, isl=64, osl=16).resolved(config)
        fits[kv] = memory_fit(config, shapes(config), load_topology("dgx-h200"), w, Layout.parse(f"TP{tp}"), 1)
    heads = 1 if config.is_mla else 2 // tp
    assert cache.static_bytes == 0 and fits["fp8"].kv_cache - fits["fp8_e5m2"].kv_cache == \
        layers * heads * (4 if config.is_mla else 8 * (1 + dim)) > 0


# --- the paged decode: reference == attend over QuantizedKV; Triton == reference ---

def quantized_batch(ctx, heads, kv_heads, dim, block_size, name):
    """q, k and v caches (QuantizedKV) of random blocks, and the block tables. "fp8_e4m3-scaled":
    e4m3 with head scales 2**-3, 2**-5, ... and random sinks, added back at each sequence's
    position 0 (layers/kv_quant.py)."""
    q, k, v, tables = paged_batch(ctx, heads, kv_heads, dim, block_size)
    caches = []
    for x, role in ((k, "k"), (v, "v")):
        c = QuantizedKV(tuple(x.shape), kv_format(name.removesuffix("-scaled")), torch.float32, role=role)
        if name.endswith("-scaled"):
            g = torch.Generator().manual_seed(3)
            c.set_static([2.0 ** -(3 + 2 * h) for h in range(kv_heads)], torch.randn(kv_heads, dim, generator=g) * 3)
            x = x * torch.tensor([2.0 ** -(3 + 2 * h) for h in range(kv_heads)])[:, None] * 16
        c.data, c.scale = quantize(x, c.format, c.head_scale)
        caches.append(c)
    return q, caches[0], caches[1], tables


@pytest.mark.parametrize("name", ["int8", "fp8", "fp8_e4m3-scaled"])
def test_reference_reads_the_quantized_cache_as_attend_does(name):
    ctx = [1, 37, 16, 50]
    q, kc, vc, tables = quantized_batch(ctx, 8, 2, 32, 16, name)
    meta = AttentionMetadata.build(tables, [n - 1 for n in ctx], [1] * len(ctx), 16)
    want = attend(q, kc, vc, meta)  # gather_blocks dequantizes
    out = ops.paged_decode_attention(q, kc.data, vc.data, meta.block_tables, torch.tensor(ctx),
                                     k_scale=kc.kernel_scale(), v_scale=vc.kernel_scale(), k_sink=kc.sink,
                                     v_sink=vc.sink)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["int8", "fp8_e4m3", "fp8_e4m3-scaled", "fp8_e5m2"])
@pytest.mark.parametrize("block_size", [16, 32])
def test_triton_kernel_reads_the_quantized_cache(triton_path, name, block_size):
    """e4m3's scale per kv head goes in as a view of strides (0, 0, 1), read in place, and its
    sinks are added to each sequence's position 0."""
    ctx = [1, 40, 16, 70, 33]  # ragged: inside one block, block edges, several blocks
    q, kc, vc, tables = quantized_batch(ctx, 8, 2, 64, block_size, name)  # GQA: 4 query heads per kv head
    lens = torch.tensor(ctx, device=DEVICE)
    args = [t.to(DEVICE) for t in (q, kc.data, vc.data, padded(tables))]
    ks, vs = kc.kernel_scale(), vc.kernel_scale()
    scales = {} if ks is None else dict(k_scale=ks.to(DEVICE), v_scale=vs.to(DEVICE))
    if name.endswith("-scaled"):
        assert ks.stride() == (0, 0, 1)  # no copy per position
        scales.update(k_sink=kc.sink.to(DEVICE), v_sink=vc.sink.to(DEVICE))
    out = ops.paged_decode_attention(*args, lens, **scales)
    want = reference.paged_decode_attention(*args, lens, **scales)
    tol = 2e-5 if DEVICE == "cpu" else 2e-4  # compiled on a GPU: another order of sums (H200: 9e-5 seen)
    torch.testing.assert_close(out, want, atol=tol, rtol=tol)
    if name.endswith("-scaled"):  # the scales and sinks are read: without either the output is another
        no_sink = {k: v for k, v in scales.items() if "sink" not in k}
        for partial in ({}, no_sink):
            assert not torch.allclose(ops.paged_decode_attention(*args, lens, **partial), want, atol=1e-3)


def test_int8_without_scales_is_refused():
    q, kc, vc, tables = quantized_batch([5], 4, 2, 16, 16, "int8")
    with pytest.raises(Exception, match="needs k_scale"):
        ops.paged_decode_attention(q, kc.data, vc.data, padded(tables), torch.tensor([5]))


# --- greedy tokens on tiny models ---

@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind,layout", [("llama", "TP1"), ("llama", "TP2"), ("deepseek_v3", "TP1")],
                         ids=["llama-TP1", "llama-TP2", "mla-TP1"])
def test_greedy_tokens_with_an_int8_and_an_fp8_cache(tiny_model, kind, layout):
    model_dir = tiny_model(kind)
    expected = reference_tokens(model_dir, PROMPTS, NEW)
    for kv, least in (("int8", 60), ("fp8", 30)):
        with LLM(model_dir, layout=layout, kv_cache_dtype=kv) as llm:
            outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
        agree = sum(_common_prefix(o.token_ids, e) for o, e in zip(outs, expected))
        assert agree >= least, (kv, agree)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["llama", "deepseek_v3"])
def test_teacher_forced_scores_through_a_quantized_cache(tiny_model, tmp_path, kind):
    """Every position of four 64-token windows scored through the int8 and the fp8 cache (scale
    1, and calibrated) against transformers' float model (see the module's docstring for the bounds)."""
    from transformers import AutoModelForCausalLM

    from atoll.engine.driver.perplexity import run_scores, windows

    model_dir = tiny_model(kind)
    ids = torch.randint(0, 301, (260,), generator=torch.Generator().manual_seed(0)).tolist()
    wins = windows(ids, 64)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor(wins)).logits.double()
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(2, torch.tensor(wins)[:, 1:, None])
    want, top = math.exp(nll.mean().item()), logits[:, :-1].argmax(-1).tolist()
    positions = sum(map(len, top))
    fp8 = (0.015, 0.94) if kind == "deepseek_v3" else (0.005, 0.86)
    calibrated = str(tmp_path / "scales.json")
    fit_scales(model_dir, 1, calibrated)  # scales fitted on other random tokens
    for kw, (rel, share) in ((dict(kv_cache_dtype="int8"), (0.005, 0.93)), (dict(kv_cache_dtype="fp8"), fp8),
                             (dict(kv_cache_dtype="fp8", kv_scales=calibrated), fp8)):
        with LLM(model_dir, max_num_seqs=4, **kw) as llm:
            scores = run_scores(llm, wins)
        same = sum(a == b for got, ref in zip(scores.top1, top) for a, b in zip(got, ref))
        assert abs(scores.perplexity / want - 1) <= rel, (kw, scores.perplexity, want)
        assert same >= share * positions, (kw, same, positions)


# --- perplexity ---

@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["TP1", "PP2"])  # PP2: the stages hand activations on per step
def test_perplexity_is_transformers_exp_mean_nll(tiny_model, layout):
    from transformers import AutoModelForCausalLM

    from atoll.engine.driver.perplexity import run_scores, windows

    model_dir = tiny_model("llama")
    ids = torch.randint(0, 301, (130,), generator=torch.Generator().manual_seed(0)).tolist()
    wins = windows(ids, 40, 125)  # 3 windows; the rest of the text is left out
    assert len(wins) == 3 and all(len(w) == 40 for w in wins)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = model(torch.tensor(wins)).logits.double()
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(2, torch.tensor(wins)[:, 1:, None])
    want = math.exp(nll.mean().item())
    with LLM(model_dir, layout=layout, max_num_seqs=2) as llm:  # two batches of windows
        scores = run_scores(llm, wins)
    assert scores.tokens == 3 * 39
    assert scores.perplexity == pytest.approx(want, rel=1e-4)
    assert scores.top1 == logits[:, :-1].argmax(-1).tolist()


def test_config_names_and_refusals():
    from atoll.config import EngineConfig

    with pytest.raises(InputError, match="kv_cache_dtype 'int4' is not one of"):
        EngineConfig(kv_cache_dtype="int4")
    # disaggregated prefill sends the quantized cache as stored (tests/engine/disagg/test_disagg_kv_quant.py)
    assert EngineConfig(kv_cache_dtype="int8", prefill="TP1", decode="TP1").kv_cache_dtype == "int8"


@pytest.mark.timeout(300)
def test_prefix_cache_shares_quantized_blocks(tiny_model):
    """The prefix cache names blocks by their tokens, whatever they hold: later requests find the
    first one's int8 blocks (the cached counts of tests/engine/batch/test_prefix_cache.py's MoE case)."""
    import test_prefix_cache
    from test_prefix_cache import PROMPTS as SHARED, NEW as SHARED_NEW, _run  # noqa: N811

    model_dir = tiny_model("llama")
    expected = reference_tokens(model_dir, SHARED, SHARED_NEW)
    original = test_prefix_cache.LLM
    test_prefix_cache.LLM = lambda *a, **kw: original(*a, kv_cache_dtype="int8", **kw)
    try:
        on = _run(model_dir, "TP1", True)
    finally:
        test_prefix_cache.LLM = original
    assert [r["metrics"]["cached_tokens"] for r in on][1:4] == [12, 12, 8]
    agree = sum(_common_prefix(r["token_ids"], e) for r, e in zip(on, expected))
    # measured: 35 of 40, with the cache on or off alike (the last prompt's tokens part from
    # transformers' at the 4th token either way: the quantization, not the sharing)
    assert agree >= len(SHARED) * SHARED_NEW - 8, agree
