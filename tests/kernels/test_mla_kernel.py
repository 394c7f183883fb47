"""mla_decode_attention: the torch reference against MLAttention's gather + SDPA decode, the
Triton kernel against the reference (plain and quantized latent caches) in Triton's interpreter
on CPU (compiled on a GPU), and a tiny DeepSeek-V3 generating with the kernels forced on. The
interpreter setup lives in test_kernels.py; its fresh-process rerun covers only
test_kernels*.py, so this file has its own."""

import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch
from reference import reference_tokens
from test_kernels import DEVICE, IN_PROCESS, TOL, assert_close, triton_path  # noqa: F401  (triton_path: fixture)
from test_paged_attention import paged_batch, padded

from atoll import LLM, SamplingParams
from atoll.kernels import backend, ops, reference
from atoll.kernels.backend import KernelError
from atoll.layers.attention import AttentionMetadata
from atoll.layers.kv_quant import QuantizedKV, kv_format, quantize
from atoll.layers.mla import MLAttention
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext

CACHES = ["float32", "int8", "fp8_e4m3", "fp8_e4m3-scaled", "fp8_e5m2"]
LATENT_SCALE = 2.0**-5  # "fp8_e4m3-scaled": e4m3 with the latent's one scale per layer


def latent_batch(ctx, heads, latent, rope, block_size, cache_dtype="float32", *, seed=0):
    """q [seqs, heads, D], a latent cache [blocks, block_size, 1, D] (a tensor, or quantized as
    data + scale), its scale (or None; e4m3's one scale as a view of strides 0, 0, 1), and the
    padded block tables; D = latent + rope."""
    q, cache, _, tables = paged_batch(ctx, heads, 1, latent + rope, block_size, seed=seed)
    scale = None
    if cache_dtype.endswith("-scaled"):
        head = torch.tensor([LATENT_SCALE])
        cache, _ = quantize(cache * LATENT_SCALE, kv_format(cache_dtype.removesuffix("-scaled")), head)
        scale = head.expand(cache.shape[:3])
    elif cache_dtype != "float32":
        cache, scale = quantize(cache, kv_format(cache_dtype))
    return q, cache, scale, padded([t or [0] for t in tables])


def _on_device(*ts):
    return [None if t is None else t.to(DEVICE) for t in ts]


# --- the reference is MLAttention's decode ---

def _mla_layer(heads=4, latent=16, rope=8, nope=12, v_dim=10):
    cfg = SimpleNamespace(hidden_size=32, num_attention_heads=heads, qk_nope_head_dim=nope, qk_rope_head_dim=rope,
                          v_head_dim=v_dim, kv_lora_rank=latent, q_lora_rank=None, attention_bias=False,
                          rope_interleave=True, rope_scaling=None)
    layer = MLAttention(cfg, ParallelContext.create(Layout(tp=1), 0), rotary=None, dtype=torch.float32)
    w = layer.kv_b_proj.weight
    with torch.no_grad():
        w.copy_(torch.randn(w.shape, generator=torch.Generator().manual_seed(1)))
    return layer


def _layer_inputs(layer, ctx, block_size, cache_dtype):
    """q_nope, q_rope, the layer's cache (a tensor or a QuantizedKV) and the decode metadata."""
    g = torch.Generator().manual_seed(2)
    q_nope = torch.randn(len(ctx), layer.heads, layer.nope, generator=g)
    q_rope = torch.randn(len(ctx), layer.heads, layer.rope, generator=g)
    _, cache, _, tables = paged_batch(ctx, 1, 1, layer.latent + layer.rope, block_size)
    if cache_dtype != "float32":
        quantized = QuantizedKV(tuple(cache.shape), kv_format(cache_dtype.removesuffix("-scaled")), torch.float32,
                                role="latent")
        if cache_dtype.endswith("-scaled"):
            quantized.set_static([LATENT_SCALE])
        quantized.data, quantized.scale = quantize(cache, quantized.format, quantized.head_scale)
        cache = quantized
    meta = AttentionMetadata.build(tables, [n - 1 for n in ctx], [1] * len(ctx), block_size)
    return q_nope, q_rope, cache, meta


@pytest.mark.parametrize("cache_dtype", ["float32", "int8", "fp8_e4m3-scaled"])
def test_reference_is_the_layers_decode(cache_dtype):
    """The reference, fed the absorbed query, then W_uv, gives what _decode's gather + SDPA gives."""
    layer = _mla_layer()
    ctx = [1, 37, 16, 50]
    q_nope, q_rope, cache, meta = _layer_inputs(layer, ctx, 16, cache_dtype)
    with torch.no_grad():
        want = layer._decode(q_nope, q_rope, cache, meta)  # CPU: the torch path
        w_uk, w_uv = layer._absorbed()
        q = torch.cat([torch.einsum("shn,hnl->shl", q_nope, w_uk), q_rope], dim=-1)
        data, scale = (cache.data, cache.kernel_scale()) if isinstance(cache, QuantizedKV) else (cache, None)
        o = reference.mla_decode_attention(q, data, meta.block_tables, torch.tensor(ctx), latent=layer.latent,
                                           scale=layer.scale, cache_scale=scale)
        out = torch.einsum("shl,hvl->shv", o, w_uv)
    assert o.shape == (4, layer.heads, layer.latent)
    torch.testing.assert_close(out, want, atol=1e-5, rtol=1e-5)


def test_reference_zero_length_rows_are_zero():
    q, cache, _, tables = latent_batch([0, 5, 0], 2, 16, 8, 4)
    out = reference.mla_decode_attention(q, cache, tables, torch.tensor([0, 5, 0]), latent=16, scale=0.2)
    assert torch.equal(out[[0, 2]], torch.zeros(2, 2, 16)) and out[1].abs().sum() > 0


# --- the Triton kernel against the reference ---

# heads, latent, rope: one head; D = 56 (not a power of two, one q.k chunk); 20 heads over two
# programs and D = 72 (a second, partial q.k chunk)
SHAPES = [(1, 40, 16), (5, 40, 16), (20, 48, 24)]
CTX = [1, 7, 0, 16, 32, 45, 0]  # one key, inside a block, block edges (16, 32), several blocks, 0


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("cache_dtype", CACHES)
@pytest.mark.parametrize("heads,latent,rope", SHAPES, ids=[f"h{h}-l{lat}-r{r}" for h, lat, r in SHAPES])
def test_kernel_matches_reference(triton_path, heads, latent, rope, cache_dtype, block_size):
    q, cache, scale, tables = _on_device(*latent_batch(CTX, heads, latent, rope, block_size, cache_dtype))
    if block_size == 32:
        tables = tables.int()
    lens = torch.tensor(CTX, device=DEVICE)
    sm = (latent + rope) ** -0.5
    out = ops.mla_decode_attention(q, cache, tables, lens, latent=latent, scale=sm, cache_scale=scale)
    want = reference.mla_decode_attention(q, cache, tables, lens, latent=latent, scale=sm, cache_scale=scale)
    assert out.shape == (len(CTX), heads, latent) and out.dtype == q.dtype
    assert_close(out, want)
    assert torch.equal(out[[2, 6]], torch.zeros_like(out[[2, 6]]))  # no keys: zeros, no NaN


def test_kernel_bfloat16_query(triton_path):
    """A bf16 model: float32 inside the kernel, one rounding at the store."""
    q, cache, _, tables = _on_device(*latent_batch([9, 40], 4, 40, 16, 16))
    lens = torch.tensor([9, 40], device=DEVICE)
    out = ops.mla_decode_attention(q.bfloat16(), cache.bfloat16(), tables, lens, latent=40, scale=0.1)
    want = reference.mla_decode_attention(q.bfloat16().float(), cache.bfloat16().float(), tables, lens,
                                          latent=40, scale=0.1).bfloat16()
    assert_close(out, want, TOL[torch.bfloat16])


@pytest.mark.parametrize("cache_dtype", ["float32", "int8"])
def test_kernel_at_deepseek_v3_widths(triton_path, cache_dtype):
    """kv_lora_rank 512 + rope 64 = 576: nine q.k chunks, a 512-wide value tile."""
    ctx = [3, 33, 0]
    q, cache, scale, tables = _on_device(*latent_batch(ctx, 4, 512, 64, 16, cache_dtype))
    lens = torch.tensor(ctx, device=DEVICE)
    out = ops.mla_decode_attention(q, cache, tables, lens, latent=512, scale=576**-0.5, cache_scale=scale)
    want = reference.mla_decode_attention(q, cache, tables, lens, latent=512, scale=576**-0.5, cache_scale=scale)
    assert_close(out, want)


@pytest.mark.parametrize("cache_dtype", ["float32", "int8", "fp8_e4m3", "fp8_e4m3-scaled"])
def test_layer_decode_takes_the_kernel(triton_path, cache_dtype):
    """MLAttention._decode on the Triton path (a QuantizedKV passes its data and scale) gives
    what its torch path gives; the fixture fails any call of the reference."""
    layer = _mla_layer()
    ctx = [1, 37, 16, 50]
    q_nope, q_rope, cache, meta = _layer_inputs(layer, ctx, 16, cache_dtype)
    with torch.no_grad():
        out = layer._decode(q_nope, q_rope, cache, meta)
        with backend.using("torch"):
            want = layer._decode(q_nope, q_rope, cache, meta)
    assert_close(out, want)


def test_input_errors_name_the_numbers():
    q, cache, scale, tables = latent_batch([5, 3], 2, 16, 8, 4, "int8")
    lens = torch.tensor([5, 3])
    with pytest.raises(KernelError, match=r"an int8 cache needs cache_scale"):
        ops.mla_decode_attention(q, cache, tables, lens, latent=16, scale=0.2)
    with pytest.raises(KernelError, match=r"the cache has D=24, q has 20"):
        ops.mla_decode_attention(q[..., :20], cache, tables, lens, latent=16, scale=0.2, cache_scale=scale)
    with pytest.raises(KernelError, match=r"latent=30 must be in 1..D=24"):
        ops.mla_decode_attention(q, cache, tables, lens, latent=30, scale=0.2, cache_scale=scale)
    with pytest.raises(KernelError, match=r"the latent cache has one head, got 2"):
        ops.mla_decode_attention(q, cache.expand(-1, -1, 2, -1), tables, lens, latent=16, scale=0.2)
    with pytest.raises(KernelError, match=r"block_tables must be \[seqs=2, max_blocks\], got \(3, 2\)"):
        ops.mla_decode_attention(q, cache, tables[[0, 1, 1]], lens, latent=16, scale=0.2, cache_scale=scale)


# --- a tiny DeepSeek-V3 with the kernels forced on ---

PROMPTS = [[5, 7, 9, 11, 13], [42, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17]]
NEW = 6


@pytest.mark.timeout(600)
def test_deepseek_v3_tokens_with_the_mla_kernel(tiny_model, monkeypatch):
    """Default cache: transformers' greedy tokens. int8 cache: the tokens of the torch path over
    the same int8 cache (quantization moves logits, so transformers is not the reference there).
    The rank is a fresh process: the environment set here picks its kernels (on CPU: Triton's
    interpreter)."""
    if torch.cuda.is_available():
        pytest.skip("checks the CPU interpreter run; on a GPU the auto path already takes the kernel")
    model_dir = tiny_model("deepseek_v3")
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    expected = reference_tokens(model_dir, PROMPTS, NEW)
    monkeypatch.setenv("ATOLL_KERNELS", "torch")
    with LLM(model_dir, layout="TP1", kv_cache_dtype="int8") as llm:
        int8_off = [o.token_ids for o in llm.generate(PROMPTS, params)]
    monkeypatch.setenv("ATOLL_KERNELS", "triton")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for kv, want in (("auto", expected), ("int8", int8_off)):
        with LLM(model_dir, layout="TP1", kv_cache_dtype=kv) as llm:
            on = [o.token_ids for o in llm.generate(PROMPTS, params)]
        assert on == want, kv
        assert all(len(t) == NEW for t in on)


@pytest.mark.skipif(IN_PROCESS, reason="triton's interpreter is usable in this process")
@pytest.mark.timeout(300)
def test_mla_kernel_in_fresh_process():
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", os.path.basename(__file__),
                        "-k", "not tokens_with"], cwd=os.path.dirname(__file__), env=env, capture_output=True,
                       text=True, timeout=290)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
