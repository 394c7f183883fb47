"""Block-fp8 linear: float8 e4m3 weights with one float32 scale per row and 128 columns, the
torch reference of kernels/triton_fp8_gemm.py, and the dispatch between them.

    quantize_activations(x [M, K]) -> (fp8 [M, K], scale [M, ceil(K / 128)])   per token per group
    quantize_weight(w [N, K]) -> (fp8 [N, K], scale [N, ceil(K / 128)])        per row per group
    dequantize_weight(w, scale, col_offset=0) -> float32 [N, K]
    gemm_reference(a, a_scale, b, b_scale, out_dtype) -> [M, N]                the kernel's math
    fp8_linear(x, w, scale, *, col_offset=0, input_scale=None) -> [M, N] in x's dtype

fp8_linear on the Triton path (CUDA, or kernels=triton in the interpreter) quantizes the
activations per token per 128 columns and multiplies fp8 by fp8 (DeepSeek-V3's recipe); on the
torch path (the CPU) it multiplies the activations as they are by the weight dequantized block
by block for this call: fp8 is what stays in memory, float32 lives only for the product.
input_scale (a float32 scalar: a checkpoint's static activation scale) makes the Triton path
quantize the activations by that one scale instead of per token per group (x / input_scale,
clamped to e4m3's range; the GEMM's activation scale is input_scale everywhere); the torch
path does not quantize the activations, so it ignores it.
col_offset: where the weight's first column sits inside its 128-column group (a row-parallel
shard of a checkpoint's block grid starting mid-block); the kernel takes 0 only.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from atoll.kernels.backend import check, use_triton

GROUP = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest float8 e4m3fn


def groups(cols: int, col_offset: int = 0) -> int:
    return -(-(col_offset + cols) // GROUP)


def _group_amax(x: torch.Tensor, col_offset: int = 0) -> torch.Tensor:
    """[rows, cols] -> [rows, groups] of |x|'s max per 128-column group."""
    rows, cols = x.shape
    g = groups(cols, col_offset)
    padded = x.new_zeros(rows, g * GROUP)
    padded[:, col_offset:col_offset + cols] = x
    return padded.view(rows, g, GROUP).abs().amax(-1)


def _expand(scale: torch.Tensor, cols: int, col_offset: int = 0) -> torch.Tensor:
    """[rows, groups] -> [rows, cols]: each column's group scale."""
    return scale.repeat_interleave(GROUP, dim=1)[:, col_offset:col_offset + cols]


def quantize_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [N, K], float32 scale [N, groups]): w ~ fp8 * scale, per row and 128 columns."""
    w = w.float()
    scale = (_group_amax(w) / FP8_MAX).clamp(min=1e-12)
    return (w / _expand(scale, w.shape[1])).clamp(-FP8_MAX, FP8_MAX).to(FP8), scale


quantize_activations = quantize_weight  # the same grouping, per token instead of per weight row


def dequantize_weight(w: torch.Tensor, scale: torch.Tensor, col_offset: int = 0) -> torch.Tensor:
    """float32 [N, K]: each 128-column group times its scale, in place on one float copy."""
    out = w.float()
    for g in range(scale.shape[1]):
        a, b = max(0, g * GROUP - col_offset), min(w.shape[1], (g + 1) * GROUP - col_offset)
        out[:, a:b] *= scale[:, g:g + 1].float()
    return out


def gemm_reference(a, a_scale, b, b_scale, out_dtype) -> torch.Tensor:
    """(a * a_scale) @ (b * b_scale).T in float32, rounded once to out_dtype."""
    return (dequantize_weight(a, a_scale) @ dequantize_weight(b, b_scale).T).to(out_dtype)


def _check(x, w, scale, col_offset) -> None:
    check(w.dtype == FP8 and w.dim() == 2, f"fp8 weight must be 2-D float8_e4m3fn, got {w.dtype} {tuple(w.shape)}")
    check(x.shape[-1] == w.shape[1], f"x has {x.shape[-1]} columns, the weight {w.shape[1]}")
    need = (w.shape[0], groups(w.shape[1], col_offset))
    check(tuple(scale.shape) == need, f"fp8 weight scale has shape {tuple(scale.shape)}, needs {need}")
    check(0 <= col_offset < GROUP, f"col_offset={col_offset} must be in [0, {GROUP})")


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp8 [M, K], float32 scale [M, groups]): x by one static scale, in the GEMM's layout."""
    s = input_scale.float().reshape(1, 1)
    q = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, s.expand(x.shape[0], groups(x.shape[1])).contiguous()


def fp8_linear(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, *, col_offset: int = 0,
               bias: torch.Tensor | None = None, input_scale: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (w * scale).T (+ bias) -> [..., N] in x's dtype (see the module docstring)."""
    _check(x, w, scale, col_offset)
    if col_offset == 0 and use_triton(x, w):
        from atoll.kernels.triton_fp8_gemm import fp8_gemm

        rows = x.reshape(-1, x.shape[-1])
        a, a_scale = quantize_activations(rows) if input_scale is None else quantize_static(rows, input_scale)
        out = fp8_gemm(a, a_scale, w, scale, out_dtype=x.dtype, group_k=GROUP).reshape(*x.shape[:-1], w.shape[0])
    else:
        out = F.linear(x, dequantize_weight(w, scale, col_offset).to(x.dtype))
    return out if bias is None else out + bias
