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
    kernels against the same steps in torch. float32: equal to 1e-5 but for an element of h
    whose fp8 rounding flips under the other summation order; bf16: h rounded to bf16 by
    truncation in the interpreter, so such flips are more common (measured below 1%)."""
    tokens, top_k, experts, hidden, inter = 11, 2, 5, 200, 72
    ids, weights = routing(tokens, top_k, experts)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(4)).to(DEVICE, dtype)
    w13, s13 = fp8_experts(experts, 2 * inter, hidden, block_scales=False)
    w2, s2 = fp8_experts(experts, hidden, inter, block_scales=False, seed=5)
    got = fp8_moe.fused_moe_fp8(x, w13, s13, w2, s2, ids, weights, config=SMALL)
    want = _torch_path(x, w13, s13, w2, s2, ids, weights)
    assert_near(got, want, {torch.float32: 1e-3, torch.bfloat16: 2**-5}[dtype])


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
