"""fp8 experts computed in fp8: the routed experts of one MoE layer whose weights are float8
e4m3 with block scales, as DeepSeek-V3 publishes them, multiplied without a float copy.

    y = fused_moe_fp8(x, w13, w13_scale, w2, w2_scale, topk_ids, topk_weights, expert_offset=0)

    x                 [tokens, hidden] in the compute dtype (bf16, fp16 or float32)
    w13, w2           float8 e4m3 [experts, 2*inter, hidden] and [experts, hidden, inter]
                      (fused_moe's layout: gate rows then up rows)
    w13_scale         float32 [experts, 2*inter or ceil(2*inter / 128), ceil(hidden / 128)]
    w2_scale          float32 [experts, hidden or ceil(hidden / 128), ceil(inter / 128)]
                      a scale per row and 128 columns (the layout layers/fp8_linear.py keeps:
                      the checkpoint's 128 x 128 block scale repeated over its rows, so a
                      moe_tp shard may start inside a block), or the checkpoint's own grid of
                      one scale per 128 x 128 block (weight_scale_inv)
    topk_ids, topk_weights, expert_offset, returns: as kernels.moe.fused_moe

The math (DeepSeek-V3's recipe, DeepGEMM's grouped GEMM): x is quantized per token and 128
columns (kernels/fp8.quantize_activations: scale = amax / 448), gate/up multiplies fp8 by fp8
with each group's float32 partial product scaled by its token's and its weight block's scales,
accumulated in float32, SiLU-and-multiply in float32, rounded once to x's dtype (h); h is
quantized the same way for the down GEMM, whose epilogue multiplies the routing weight; the
top-k rows are summed in float32 (unpermute_reduce). On the Triton path the two GEMMs are
kernels/triton_fp8_grouped_gemm.py over moe_align's layout; the activation quantization is
torch ops on the device (no host sync): a Triton quantizer could not be tested here, as the
interpreter (Triton 3.x) casts float32 to e4m3 wrongly where rounding carries into the next
power of two (-31.53 becomes -16, not -32). On the torch path every step is the torch reference
below (fp8_grouped_gemm_reference: the activations and weights dequantized to float32 and
multiplied), which is what the kernel is tested against.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atoll.kernels import reference
from atoll.kernels.alignment import MoeAlignment
from atoll.kernels.backend import check, use_triton
from atoll.kernels.configs import GemmConfig, MoeConfig, gemm_config, moe_config
from atoll.kernels.moe import check_moe_shapes
from atoll.kernels.fp8 import FP8, GROUP, dequantize_weight, groups, quantize_activations


def scale_rows(rows: int, scale: torch.Tensor) -> int:
    """Weight rows per scale row: 1 (a scale per row) or GROUP (one per 128 x 128 block)."""
    if scale.shape[-2] == rows:
        return 1
    check(scale.shape[-2] == -(-rows // GROUP),
          f"fp8 weight scale has {scale.shape[-2]} rows; needs {rows} (per row) or {-(-rows // GROUP)} (per block)")
    return GROUP


def _expanded(w: torch.Tensor, scale: torch.Tensor, per: int) -> torch.Tensor:
    """One expert's fp8 weight [N, K] as float32, its scale [N / per, groups] per row first."""
    return dequantize_weight(w, scale.repeat_interleave(per, dim=0)[: w.shape[0]])


def fp8_grouped_gemm_reference(a, a_scale, w, w_scale, align: MoeAlignment, *, gather: bool = False,
                               silu_mul: bool = False, weights=None, out_dtype=torch.bfloat16) -> torch.Tensor:
    """The kernel's math in torch: row r of the aligned layout, (a * a_scale)[row] @ (w[e] *
    w_scale[e]).T in float32, then the epilogues (silu(gate) * up; the routing weight) and one
    rounding to out_dtype. Rows without a pair are 0."""
    per = scale_rows(w.shape[1], w_scale)
    n = w.shape[1] // 2 if silu_mul else w.shape[1]
    out = torch.zeros(align.max_rows, n, dtype=out_dtype, device=a.device)
    rows = align.valid_rows().nonzero().squeeze(1)
    pair = align.sorted_ids[rows].long()
    src = pair // align.top_k if gather else rows
    x = dequantize_weight(a[src], a_scale[src])  # [valid rows, K] float32
    expert = align.block_expert[rows // align.block_m].long()
    for e in expert.unique().tolist():
        sel = expert == e
        y = x[sel] @ _expanded(w[e], w_scale[e], per).T
        if silu_mul:
            gate, up = y.chunk(2, dim=-1)
            y = F.silu(gate) * up
        if weights is not None:
            y = y * weights.reshape(-1)[pair[sel]].float()[:, None]
        out[rows[sel]] = y.to(out_dtype)
    return out


def fp8_grouped_gemm(a: torch.Tensor, a_scale: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor,
                     align: MoeAlignment, *, gather: bool = False, silu_mul: bool = False,
                     weights: torch.Tensor | None = None, out_dtype: torch.dtype = torch.bfloat16,
                     config: GemmConfig | None = None) -> torch.Tensor:
    """grouped_gemm (kernels/ops.py) over fp8 a [tokens or max_rows, K] with a_scale [rows,
    ceil(K / 128)] and fp8 w [experts, N_w, K] with w_scale (see the module docstring) ->
    [max_rows, N] in out_dtype."""
    check(a.dtype == FP8 and w.dtype == FP8, f"a and w must be float8_e4m3fn, got {a.dtype} and {w.dtype}")
    check(a.dim() == 2 and w.dim() == 3, f"a must be 2-D and w 3-D, got {a.dim()}-D and {w.dim()}-D")
    k = w.shape[2]
    check(a.shape[1] == k, f"a has K={a.shape[1]} columns but w has K={k}")
    rows = align.tokens if gather else align.max_rows
    check(a.shape[0] == rows, f"a has {a.shape[0]} rows, expected {rows} ({'tokens' if gather else 'max_rows'})")
    check(a_scale.dtype == torch.float32 and tuple(a_scale.shape) == (rows, groups(k)),
          f"a_scale must be float32 [{rows}, {groups(k)}], got {a_scale.dtype} {tuple(a_scale.shape)}")
    check(w.shape[0] >= align.experts, f"w holds {w.shape[0]} experts, the alignment {align.experts}")
    check(w_scale.dtype == torch.float32 and w_scale.dim() == 3 and w_scale.shape[0] == w.shape[0]
          and w_scale.shape[2] == groups(k),
          f"w_scale must be float32 [{w.shape[0]}, rows, {groups(k)}], got {w_scale.dtype} {tuple(w_scale.shape)}")
    per = scale_rows(w.shape[1], w_scale)
    check(not silu_mul or w.shape[1] % 2 == 0, f"silu_mul needs an even w.shape[1], got {w.shape[1]}")
    if weights is not None:
        check(weights.numel() == align.pairs, f"weights has {weights.numel()} entries, expected {align.pairs} (tokens*top_k)")
    if not use_triton(a, w):
        return fp8_grouped_gemm_reference(a, a_scale, w, w_scale, align, gather=gather, silu_mul=silu_mul,
                                          weights=weights, out_dtype=out_dtype)
    from atoll.kernels.triton_fp8_grouped_gemm import fp8_grouped_gemm as run

    config = config or gemm_config(align.block_m, silu_mul=silu_mul)
    check(GROUP % config.block_k == 0, f"block_k={config.block_k} must divide the scale group {GROUP}")
    return run(a, a_scale, w, w_scale, align, gather=gather, silu_mul=silu_mul, weights=weights,
               out_dtype=out_dtype, scale_n=per, group_k=GROUP, config=config)


def fused_moe_fp8(x: torch.Tensor, w13: torch.Tensor, w13_scale: torch.Tensor, w2: torch.Tensor,
                  w2_scale: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                  expert_offset: int = 0, config: MoeConfig | None = None) -> torch.Tensor:
    """[tokens, hidden] in x's dtype (see the module docstring)."""
    check(x.dim() == 2 and x.is_floating_point() and x.dtype != FP8,
          f"x must be [tokens, hidden] in a float dtype, got {x.dtype} {tuple(x.shape)}")
    tokens, hidden, experts, inter = check_moe_shapes(x, w13, w2, topk_ids, topk_weights)
    if tokens == 0:
        return x.new_zeros(0, hidden)
    top_k = topk_ids.shape[1]
    cfg = config or moe_config(tokens, top_k, experts)
    triton = use_triton(x, w13, w2, topk_ids, topk_weights)
    if triton:
        from atoll.kernels.triton_moe_align import moe_align
        from atoll.kernels.triton_unpermute import unpermute_reduce
    else:
        moe_align, unpermute_reduce = reference.moe_align, reference.unpermute_reduce
    align = moe_align(topk_ids, experts, cfg.block_m, expert_offset=expert_offset)
    a, a_scale = quantize_activations(x)                                   # [tokens, hidden] fp8
    h = fp8_grouped_gemm(a, a_scale, w13, w13_scale, align, gather=True, silu_mul=True,
                         out_dtype=x.dtype, config=cfg.gemm1)              # [max_rows, inter]
    b, b_scale = quantize_activations(h)                                   # [max_rows, inter] fp8
    y = fp8_grouped_gemm(b, b_scale, w2, w2_scale, align, weights=topk_weights,
                         out_dtype=x.dtype, config=cfg.gemm2)              # [max_rows, hidden]
    return unpermute_reduce(y, align)                                      # [tokens, hidden]
