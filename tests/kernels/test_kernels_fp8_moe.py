"""fp8 experts computed in fp8 (kernels/fp8_moe.py, kernels/triton_fp8_grouped_gemm.py): the
fp8 grouped GEMM against its torch reference in Triton's interpreter on CPU (compiled on a
GPU), fused_moe_fp8's Triton path against its torch path, and the MoE layer's Experts with
fp8 weights on the Triton path against the dequantize-then-multiply path the CPU keeps.
The interpreter setup lives in test_kernels.py."""

import pytest
import torch

from test_kernels import triton_path  # noqa: F401  (fixture)
from test_kernels_moe import DEVICE, routing

from atoll.comm.group import Group
from atoll.kernels import backend, fp8_moe, reference
from atoll.kernels.backend import KernelError
from atoll.kernels.configs import GemmConfig, MoeConfig
from atoll.kernels.fp8 import FP8, dequantize_weight, quantize_activations, quantize_weight
from atoll.layers import fp8_linear
from atoll.layers.moe import Experts

# K tiles of 32 inside 128-column groups: 4 tiles a group, the last group partial when K % 128
SMALL = MoeConfig(16, GemmConfig(32, 32), GemmConfig(32, 32))
REFERENCE = fp8_moe.fp8_grouped_gemm_reference  # kept before the fixture below stubs it out
# float32 out: sums in another order. bf16 out: the interpreter rounds by truncation (2 ulps)
TOL = {torch.float32: 1e-5, torch.bfloat16: 2**-6}

# tokens, top_k, experts, block_m, K, N
CASES = [
    (1, 1, 4, 16, 128, 64),    # one token, top-1: one real row in a 16-row block, three empty experts
    (5, 2, 4, 16, 200, 72),    # K not a multiple of 128 (a partial last group); the last expert empty
    (13, 3, 6, 32, 256, 40),   # uneven groups: every expert's rows far from a whole block
    (9, 8, 8, 16, 96, 48),     # top-8 of 8; K under one group
]
IDS = [f"t{t}-k{k}-e{e}-bm{bm}-K{kk}-N{n}" for t, k, e, bm, kk, n in CASES]


@pytest.fixture
def fp8_triton(triton_path, monkeypatch):
    """The Triton path, with fp8_moe's references stubbed to fail if they run."""
    def refuse(*a, **k):
        raise AssertionError("a torch reference ran on the forced Triton path")
    monkeypatch.setattr(fp8_moe, "fp8_grouped_gemm_reference", refuse)
    monkeypatch.setattr(fp8_moe, "reference", type("R", (), {"__getattr__": lambda s, n: refuse})())
    yield


def fp8_experts(experts, rows, k, *, block_scales, seed=0):
    """(fp8 [experts, rows, k], float32 scale) with the rows' magnitudes spread over 100x, so a
    scale applied to the wrong row or group shows: per row and 128 columns, or (block_scales)
    one per 128 x 128 block as a checkpoint's weight_scale_inv."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(experts, rows, k, generator=g) * torch.logspace(-1, 1, rows)[:, None] / k**0.5
    if not block_scales:
        qs = [quantize_weight(w[e]) for e in range(experts)]
        return torch.stack([q for q, _ in qs]).to(DEVICE), torch.stack([s for _, s in qs]).to(DEVICE)
    nr, nc = -(-rows // 128), -(-k // 128)
    padded = w.new_zeros(experts, nr * 128, nc * 128)
    padded[:, :rows, :k] = w
    blocks = padded.view(experts, nr, 128, nc, 128)
    scale = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-12) / 448.0  # [experts, nr, nc]
    q = (blocks / scale[:, :, None, :, None]).view(experts, nr * 128, nc * 128)[:, :rows, :k]
    return q.to(FP8).contiguous().to(DEVICE), scale.to(DEVICE)


def activations(rows, k, seed=1):
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(seed)) * 3
    return tuple(t.to(DEVICE) for t in quantize_activations(x))


def assert_near(got, want, tol):
    assert got.dtype == want.dtype and got.shape == want.shape
    err = (got.float() - want.float()).abs().max().item()
    assert err <= tol * want.float().abs().max().item(), err


@pytest.mark.parametrize("out_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_scales", [False, True], ids=["row-scales", "block-scales"])
@pytest.mark.parametrize("tokens,top_k,experts,block_m,k,n", CASES, ids=IDS)
def test_fp8_grouped_gemms(fp8_triton, tokens, top_k, experts, block_m, k, n, block_scales, out_dtype):
    ids, weights = routing(tokens, top_k, experts)
    align = reference.moe_align(ids, experts, block_m)
    cfg = GemmConfig(32, 32)
    used = int(align.rows)
    # gate/up: gathered token rows, [gate; up] weights, SiLU-and-multiply
    a, a_s = activations(tokens, k)
    w, w_s = fp8_experts(experts, 2 * n, k, block_scales=block_scales)
    got = fp8_moe.fp8_grouped_gemm(a, a_s, w, w_s, align, gather=True, silu_mul=True, out_dtype=out_dtype, config=cfg)
    want = REFERENCE(a, a_s, w, w_s, align, gather=True, silu_mul=True, out_dtype=out_dtype)
    assert_near(got[:used], want[:used], TOL[out_dtype])
    # down: the aligned rows, the routing weight in the epilogue
    h, h_s = activations(align.max_rows, n, seed=2)
    w2, w2_s = fp8_experts(experts, k, n, block_scales=block_scales, seed=3)
    got = fp8_moe.fp8_grouped_gemm(h, h_s, w2, w2_s, align, weights=weights, out_dtype=out_dtype, config=cfg)
    want = REFERENCE(h, h_s, w2, w2_s, align, weights=weights, out_dtype=out_dtype)
    assert_near(got[:used], want[:used], TOL[out_dtype])
    pad = (align.sorted_ids[:used] >= align.pairs).cpu()
    assert pad.any() and (got[:used][pad] == 0).all()  # padding rows stay 0


def test_reference_is_the_dequantized_product():
    """The reference against the plain definition: one row of each expert by hand."""
    ids, weights = routing(6, 2, 4)
    align = reference.moe_align(ids, 4, 16)
    a, a_s = activations(6, 200)
    w, w_s = fp8_experts(4, 2 * 24, 200, block_scales=True)
    got = REFERENCE(a, a_s, w, w_s, align, gather=True, silu_mul=True, out_dtype=torch.float32)
    x = dequantize_weight(a, a_s)
    for row in align.valid_rows().nonzero().squeeze(1).tolist():
        pair = int(align.sorted_ids[row])
        e = int(align.block_expert[row // 16])
        full = w_s[e].repeat_interleave(128, 0).repeat_interleave(128, 1)[:48, :200]
        y = x[pair // 2] @ (w[e].float() * full).T
        want = torch.nn.functional.silu(y[:24]) * y[24:]
        torch.testing.assert_close(got[row], want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_moe_fp8_triton_is_its_torch_path(fp8_triton, dtype):
    """The whole fp8 pipeline (align, quantize x, gate/up, quantize h, down, unpermute) on the
    kernels against the same steps in torch. float32: measured 5e-7 of the largest output
    (an element of h whose fp8 rounding flipped under the other summation order would show as
    up to 2**-4 of it). bf16: the interpreter rounds h to bf16 by truncation, a unit in the last
    place on 18% of h, which moves group amaxes and so whole groups' fp8 rounding: measured
    2.9% of the largest output (on a GPU h is rounded to nearest, as torch does)."""
    tokens, top_k, experts, hidden, inter = 11, 2, 5, 200, 72
    ids, weights = routing(tokens, top_k, experts)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    w13, s13 = fp8_experts(experts, 2 * inter, hidden, block_scales=False)
    w2, s2 = fp8_experts(experts, hidden, inter, block_scales=False, seed=5)
    got = fp8_moe.fused_moe_fp8(x, w13, s13, w2, s2, ids, weights, config=SMALL)
    want = _torch_path(x, w13, s13, w2, s2, ids, weights)
    assert_near(got, want, {torch.float32: 1e-5, torch.bfloat16: 2**-4}[dtype])


def _torch_path(*args):
    """fused_moe_fp8 on the torch path, with the real references (the fixture stubbed them)."""
    mp = pytest.MonkeyPatch()
    mp.setattr(fp8_moe, "fp8_grouped_gemm_reference", REFERENCE)
    mp.setattr(fp8_moe, "reference", reference)
    try:
        with backend.using("torch"):
            return fp8_moe.fused_moe_fp8(*args, config=SMALL)
    finally:
        mp.undo()


# --- the MoE layer's experts kept in fp8 ---

HIDDEN, INTER, E = 256, 144, 4  # hidden two whole groups; inter one and a partial group


def fp8_layer(dtype=torch.bfloat16):
    """Experts as `--quantization fp8` makes them (keep_fp8), filled through their own weight
    loaders from float checkpoint tensors (quantized as read, per row and 128 columns)."""
    ex = Experts(range(E), HIDDEN, INTER, Group.single(), dtype=dtype)
    fp8_linear.keep_fp8(ex, "w13", "w13_scale")
    fp8_linear.keep_fp8(ex, "w2", "w2_scale")
    g = torch.Generator().manual_seed(7)
    for e in range(E):
        for part in (0, 1):
            ex.w13.weight_loader(ex.w13, torch.randn(INTER, HIDDEN, generator=g) / HIDDEN**0.5, (e, part))
        ex.w2.weight_loader(ex.w2, torch.randn(HIDDEN, INTER, generator=g) / INTER**0.5, (e, "down"))
    return ex.to(DEVICE)


def layer_inputs(rows=9, k=2, dtype=torch.bfloat16):
    ids, weights = routing(rows, k, E, seed=3)
    ids[2, 1] = -1  # a slot routed to another rank's expert
    x = torch.randn(rows, HIDDEN, generator=torch.Generator().manual_seed(8)).to(DEVICE, dtype)
    return x, ids, weights


# the layer's Triton path against fused_moe_fp8's torch path: float32 measured 5e-7 of the
# largest output; bf16 2.9% (the interpreter's bf16 truncation of h, see above)
SAME = {torch.float32: 1e-5, torch.bfloat16: 2**-4}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fp8_experts_on_the_triton_path_compute_in_fp8(fp8_triton, monkeypatch, dtype):
    """On the Triton path (as on CUDA) the layer's fp8 experts are never dequantized: both of
    its entry points (weighted: the gather exchange; forward: the all-to-all's rows) give
    fused_moe_fp8's torch path, and the dequantize-then-multiply path within fp8's error."""
    ex = fp8_layer(dtype)
    assert ex.w13.dtype == FP8 and ex.w2.dtype == FP8
    x, ids, weights = layer_inputs(dtype=dtype)
    args = (ex.w13, ex.w13_scale, ex.w2, ex.w2_scale)

    def no_dequantize(*a, **k):
        raise AssertionError("fp8 experts dequantized on the Triton path")
    monkeypatch.setattr(fp8_linear, "dequantized", no_dequantize)
    got = ex.weighted(x, ids, weights)
    assert_near(got, _torch_path(x, *args, ids, weights), SAME[dtype])
    one = ids[:, :1].clamp(min=0)
    got_rows = ex(x, one[:, 0])
    assert_near(got_rows, _torch_path(x, *args, one, torch.ones_like(weights[:, :1])), SAME[dtype])
    monkeypatch.undo()
    with backend.using("torch"):  # the CPU's path: the weights dequantized, x not quantized
        dense = ex.weighted(x, ids, weights)
    # x and h rounded to e4m3 (relative 2**-4 each) on top of the same weights: measured 5.5%
    # (float32) and 6.6% (bf16) of the output's largest magnitude, 4% on average; a scale
    # dropped or misplaced is 30%+
    assert_near(got, dense, 0.1)


def test_one_line_errors_name_the_field():
    ids, weights = routing(3, 2, E)
    align = reference.moe_align(ids, E, 16)
    a, a_s = activations(3, HIDDEN)
    w, w_s = fp8_experts(E, 64, HIDDEN, block_scales=False)
    with pytest.raises(KernelError, match="fp8 weight scale has 5 rows; needs 64 .per row. or 1 .per block."):
        fp8_moe.fp8_grouped_gemm(a, a_s, w, w_s[:, :5], align, gather=True)
    with pytest.raises(KernelError, match=r"a_scale must be float32 \[3, 2\]"):
        fp8_moe.fp8_grouped_gemm(a, a_s[:, :1], w, w_s, align, gather=True)
    with pytest.raises(KernelError, match="a and w must be float8_e4m3fn"):
        fp8_moe.fp8_grouped_gemm(a.float(), a_s, w, w_s, align, gather=True)
