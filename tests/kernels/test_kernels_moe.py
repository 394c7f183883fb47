"""The MoE kernels (moe_align, grouped_gemm, unpermute_reduce, fused_moe) against their torch
references, in Triton's interpreter on CPU (compiled on a GPU); fused_moe also against
transformers' MixtralExperts. The interpreter setup lives in test_kernels.py."""

import pytest
import torch

from test_kernels import DEVICE, TOL, assert_close, triton_path  # noqa: F401  (triton_path: fixture)

from atoll import kernels  # noqa: E402
from atoll.kernels import backend, reference  # noqa: E402
from atoll.kernels.configs import GemmConfig, MoeConfig  # noqa: E402

HIDDEN, INTER = 48, 40  # neither a multiple of the small tiles below
SMALL = MoeConfig(16, GemmConfig(32, 32), GemmConfig(32, 32))  # K and N loops of 2, the last partial
# fused_moe's reference rounds gate/up, h and each expert's output to bf16 (transformers' math);
# the kernels keep them in float32 until one rounding, so bf16 differs by a few ulps
MOE_TOL = {torch.float32: 2e-5, torch.bfloat16: 2**-5}

# tokens, top_k, experts, block_m
CASES = [
    (1, 1, 4, 16),     # a single token, top-1: one real row in a 16-row block
    (5, 2, 4, 16),     # the last expert gets no tokens (as in every case with top_k < experts)
    (9, 8, 8, 16),     # top-8 of 8: every token in every expert
    (40, 8, 12, 32),   # 320 pairs: three moe_align chunks; 12 experts, not a power of two
    (13, 3, 6, 64),    # every expert's rows far from a whole block
]
IDS = [f"t{t}-k{k}-e{e}-bm{bm}" for t, k, e, bm in CASES]


def routing(tokens, top_k, experts, seed=0):
    """Distinct experts per token; the last expert stays empty unless top_k == experts."""
    g = torch.Generator().manual_seed(seed)
    pool = experts if top_k == experts else experts - 1
    ids = torch.stack([torch.randperm(pool, generator=g)[:top_k] for _ in range(tokens)])
    weights = torch.rand(tokens, top_k, generator=g)
    return ids.to(DEVICE), (weights / weights.sum(-1, keepdim=True)).to(DEVICE)


def weights_for(experts, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=g) / HIDDEN**0.5
    w2 = torch.randn(experts, HIDDEN, INTER, generator=g) / INTER**0.5
    return w13.to(DEVICE, dtype), w2.to(DEVICE, dtype)


def tokens_for(tokens, dtype, seed=1):
    return torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(seed)).to(DEVICE, dtype)


def check_layout(align, topk_ids, expert_offset=0):
    """The layout's invariants, independent of either implementation."""
    pairs, bm = topk_ids.numel(), align.block_m
    local = (topk_ids.reshape(-1) - expert_offset).cpu()
    is_local = (local >= 0) & (local < align.experts)
    sorted_ids, block_expert = align.sorted_ids.cpu(), align.block_expert.cpu()
    used = int(align.rows.item())
    assert used % bm == 0 and used <= align.max_rows
    real = sorted_ids[sorted_ids < pairs]
    assert sorted(real.tolist()) == is_local.nonzero().squeeze(1).tolist()  # every local pair once
    assert (sorted_ids[used:] == pairs).all() and (block_expert[used // bm:] == -1).all()
    for b in range(used // bm):
        rows = sorted_ids[b * bm: (b + 1) * bm]
        ids = rows[rows < pairs]
        assert len(ids) > 0, f"block {b} is all padding"
        assert (local[ids.long()] == block_expert[b]).all(), f"block {b} mixes experts"
        assert ids.tolist() == sorted(ids.tolist()) and (rows[: len(ids)] == ids).all()  # padding last
    position = align.position.cpu()
    assert (position[~is_local] == -1).all()
    assert (sorted_ids[position[is_local].long()] == is_local.nonzero().squeeze(1)).all()


# --- moe_align ---

@pytest.mark.parametrize("tokens,top_k,experts,block_m", CASES, ids=IDS)
def test_moe_align(triton_path, tokens, top_k, experts, block_m):
    ids, _ = routing(tokens, top_k, experts)
    got = kernels.moe_align(ids, experts, block_m)
    want = reference.moe_align(ids, experts, block_m)
    check_layout(want, ids)
    for field in ("sorted_ids", "block_expert", "rows", "position"):
        assert torch.equal(getattr(got, field).cpu(), getattr(want, field).cpu()), field


def test_moe_align_keeps_only_local_experts(triton_path):
    """This rank holds experts 4..7 of 12; ids of other ranks and negative (dropped) ids are left out."""
    ids, _ = routing(21, 4, 12, seed=3)
    ids[0, 0] = -1
    got = kernels.moe_align(ids, 4, 16, expert_offset=4)
    want = reference.moe_align(ids, 4, 16, expert_offset=4)
    check_layout(want, ids, expert_offset=4)
    for field in ("sorted_ids", "block_expert", "rows", "position"):
        assert torch.equal(getattr(got, field).cpu(), getattr(want, field).cpu()), field


def test_moe_align_loops_over_many_chunks_and_blocks(triton_path, monkeypatch):
    """Small chunk and step sizes, so every grid-stride and tile loop of the three kernels runs
    several times (the real sizes need far more pairs than the interpreter can take)."""
    import atoll.kernels.triton_moe_align as mod

    for name, value in (("ALIGN_BLOCK", 32), ("FILL", 16), ("B_STEP", 2), ("TILE_P", 4)):
        monkeypatch.setattr(mod, name, value)
    ids, _ = routing(40, 8, 12)
    got = mod.moe_align(ids, 12, 16)  # 10 chunks in 3 tiles; 32 blocks, 20 per grid stride
    want = reference.moe_align(ids, 12, 16)
    for field in ("sorted_ids", "block_expert", "rows", "position"):
        assert torch.equal(getattr(got, field).cpu(), getattr(want, field).cpu()), field


# --- grouped_gemm, unpermute_reduce ---

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens,top_k,experts,block_m", [CASES[0], CASES[1], CASES[3]], ids=[IDS[0], IDS[1], IDS[3]])
def test_grouped_gemms(triton_path, dtype, tokens, top_k, experts, block_m):
    ids, topk_weights = routing(tokens, top_k, experts)
    w13, w2 = weights_for(experts, dtype)
    x = tokens_for(tokens, dtype)
    align = reference.moe_align(ids, experts, block_m)
    used = int(align.rows.item())
    cfg = GemmConfig(32, 32)
    # gemm 1: gather the tokens' rows, gate/up, SiLU-and-multiply
    h = kernels.grouped_gemm(x, w13, align, gather=True, silu_mul=True, config=cfg)
    h_want = reference.grouped_gemm(x, w13, align, gather=True, silu_mul=True)
    assert h.shape == (align.max_rows, INTER)
    assert_close(h[:used], h_want[:used])
    # gemm 2: aligned rows in, routing weight applied
    y = kernels.grouped_gemm(h_want, w2, align, weights=topk_weights, config=cfg)
    y_want = reference.grouped_gemm(h_want, w2, align, weights=topk_weights)
    assert_close(y[:used], y_want[:used])
    # and with the default (table) tiles: one K step, masked
    assert_close(kernels.grouped_gemm(h_want, w2, align)[:used], reference.grouped_gemm(h_want, w2, align)[:used])


def test_grouped_gemm_drops_pipeline_stages_when_shared_memory_runs_out(triton_path, monkeypatch):
    import atoll.kernels.triton_grouped_gemm as mod

    real, tried = mod._grouped_gemm_kernel, []

    class SmallGpu:  # launches fail above 2 stages, as a big tile would on a GPU with less smem
        def __getitem__(self, grid):
            def launch(*args, num_stages, **meta):
                tried.append(num_stages)
                if num_stages > 2:
                    raise mod.OutOfResources(300_000, 101_376, "shared memory")
                return real[grid](*args, num_stages=num_stages, **meta)
            return launch

    monkeypatch.setattr(mod, "_grouped_gemm_kernel", SmallGpu())
    ids, _ = routing(3, 2, 4)
    w13, _ = weights_for(4, torch.float32)
    x = tokens_for(3, torch.float32)
    align = reference.moe_align(ids, 4, 16)
    got = kernels.grouped_gemm(x, w13, align, gather=True, config=GemmConfig(32, 32, num_stages=4))
    assert tried == [4, 3, 2]
    used = int(align.rows.item())
    assert_close(got[:used], reference.grouped_gemm(x, w13, align, gather=True)[:used])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("with_weights", [False, True], ids=["sum", "weighted"])
def test_unpermute_reduce(triton_path, dtype, with_weights):
    ids, topk_weights = routing(11, 3, 8, seed=2)
    ids[0] = torch.tensor([0, 1, 6])  # token 0 has no slot on this rank
    align = reference.moe_align(ids, 4, 16, expert_offset=2)  # some slots are another rank's
    y = torch.randn(align.max_rows, 72).to(DEVICE, dtype)
    w = topk_weights if with_weights else None
    got = kernels.unpermute_reduce(y, align, weights=w)
    assert_close(got, reference.unpermute_reduce(y, align, weights=w))
    # independent of both: each token's sum, slot by slot
    local = ((ids >= 2) & (ids < 6)).cpu()
    for t in range(11):
        want = torch.zeros(72)
        for j in range(3):
            if local[t, j]:
                want += y[align.position[t * 3 + j]].float().cpu() * (topk_weights[t, j].item() if with_weights else 1.0)
        torch.testing.assert_close(got[t].float().cpu(), want, rtol=TOL[dtype], atol=TOL[dtype] * 8)


# --- fused_moe ---

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("tokens,top_k,experts,block_m", CASES, ids=IDS)
def test_fused_moe(triton_path, dtype, tokens, top_k, experts, block_m):
    ids, topk_weights = routing(tokens, top_k, experts)
    w13, w2 = weights_for(experts, dtype)
    x = tokens_for(tokens, dtype)
    config = MoeConfig(block_m, SMALL.gemm1, SMALL.gemm2)
    got = kernels.fused_moe(x, w13, w2, ids, topk_weights, config=config)
    assert_close(got, reference.fused_moe(x, w13, w2, ids, topk_weights), tol=MOE_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_fused_moe_expert_parallel_halves_add_up(triton_path, dtype):
    """Two ranks holding experts 0-3 and 4-7 each add their part; the parts sum to the whole."""
    ids, topk_weights = routing(7, 2, 8, seed=5)
    w13, w2 = weights_for(8, dtype)
    x = tokens_for(7, dtype)
    parts = [kernels.fused_moe(x, w13[r * 4:(r + 1) * 4], w2[r * 4:(r + 1) * 4], ids, topk_weights,
                               expert_offset=r * 4) for r in (0, 1)]
    for r, part in enumerate(parts):
        want = reference.fused_moe(x, w13[r * 4:(r + 1) * 4], w2[r * 4:(r + 1) * 4], ids, topk_weights,
                                   expert_offset=r * 4)
        assert_close(part, want, tol=MOE_TOL[dtype])
    whole = reference.fused_moe(x, w13, w2, ids, topk_weights)
    assert_close((parts[0].float() + parts[1].float()).to(dtype), whole, tol=2 * MOE_TOL[dtype])


def test_fused_moe_rank_whose_experts_get_no_tokens_gives_zeros(triton_path):
    ids, topk_weights = routing(5, 2, 4)  # experts 0-2 only; this rank holds 4-7
    w13, w2 = weights_for(4, torch.float32)
    x = tokens_for(5, torch.float32)
    got = kernels.fused_moe(x, w13, w2, ids, topk_weights, expert_offset=4, config=SMALL)
    assert torch.equal(got, torch.zeros_like(x))


def test_fused_moe_default_config_and_no_tokens(triton_path):
    ids, topk_weights = routing(6, 2, 4)
    w13, w2 = weights_for(4, torch.float32)
    x = tokens_for(6, torch.float32)
    assert_close(kernels.fused_moe(x, w13, w2, ids, topk_weights), reference.fused_moe(x, w13, w2, ids, topk_weights))
    empty = kernels.fused_moe(x[:0], w13, w2, ids[:0], topk_weights[:0])
    assert empty.shape == (0, HIDDEN)


@pytest.mark.parametrize("path", ["triton", "torch"])
def test_fused_moe_matches_transformers_mixtral_experts(request, monkeypatch, path):
    """The weight layout is transformers' own: MixtralExperts.gate_up_proj / down_proj as is."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    config = MixtralConfig(hidden_size=HIDDEN, intermediate_size=INTER, num_local_experts=6,
                           num_experts_per_tok=2, hidden_act="silu")
    torch.manual_seed(0)
    experts = MixtralExperts(config).to(DEVICE)
    for p in experts.parameters():
        torch.nn.init.normal_(p, std=0.1)
    ids, topk_weights = routing(10, 2, 6, seed=4)
    x = tokens_for(10, torch.float32)
    with torch.no_grad():
        want = experts(x, ids, topk_weights)
        if path == "triton":
            request.getfixturevalue("triton_path")
        with backend.using("triton" if path == "triton" else "torch"):
            got = kernels.fused_moe(x, experts.gate_up_proj, experts.down_proj, ids, topk_weights, config=SMALL)
    assert_close(got, want)


# --- atoll bench kernels ---

def test_bench_without_gpu_says_so_in_one_line(capsys):
    if DEVICE == "cuda":
        pytest.skip("this machine has a GPU")
    from atoll.bench import kernels as bench

    assert bench.main([]) == 0
    assert capsys.readouterr().out.strip().count("\n") == 0


def test_bench_smoke_runs_every_row(triton_path, tmp_path, capsys):
    """The bench's own code, end to end on tiny shapes (its times mean nothing here)."""
    if DEVICE == "cuda":
        pytest.skip("--smoke is the CPU interpreter's run; on a GPU gpu_check.sh runs the real bench")
    import json

    from atoll.bench import kernels as bench

    out = tmp_path / "bench.json"
    assert bench.main(["--smoke", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    kinds = {r["kernel"].strip() for r in rows}
    assert kinds == {"fused_moe", "fused_moe_fp8", "moe_align", "gemm1 silu*up", "gemm2 *weight", "unpermute", "rms_norm+res", "rotary"}
    assert all(r["us"] > 0 and r["floor_us"] > 0 for r in rows)
