"""Weight-only int8 linears (`--quantization int8`): each output row of a weight is stored as
int8 with one bfloat16 scale, w[o, :] ~ q[o, :] * scale[o] (symmetric, scale = amax / 127,
rounded to bf16 before the rows are rounded, so q * scale is exactly what the kernels
multiply by). Activations stay in the compute dtype.

Products (layers.packed.linear sends a weight that has a scale here):
- inside the compiled CPU decode step at one row: the row reduction (q * x).sum(-1) * scale,
  which inductor turns into one vectorised pass over the int8 weight with float32 sums;
- eager products of BF16_GEMM_MIN_ROWS rows or more (prefill) on a CPU that computes bfloat16 in
  hardware (AVX512-BF16 or AMX): the int8 weight converted to bfloat16 for the call (exact:
  |q| <= 127 fits bf16's 8 significant bits) and multiplied by bfloat16 activations through
  oneDNN's bf16 GEMM (float32 sums), the scale applied to its output. On a 2-core AMD EPYC
  (Zen 4) SmolLM2's four product shapes took 1.9 ms at 64 rows against 3.5 ms through
  _weight_int8pack_mm and 3.4 ms as float32 F.linear, 5.6 / 13.9 / 12.7 ms at 256 rows, and
  tied at 16 rows, where the conversion's pass over the weight is no longer small beside the
  product (1.10 / 1.01 / 1.52 ms); fewer rows lose (0.64 / 0.13 ms at one row);
- everywhere else on the CPU: torch's int8 weight-only kernel, aten._weight_int8pack_mm,
  on bfloat16 activations (its float32 path is a slow loop; bfloat16 is its fast one), the
  output cast back to the compute dtype. It needs in_features % 16 == 0 (it crashes or is
  wrong otherwise); other widths multiply by the dequantized weight.

Which weights are quantized: models/quantize.py.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn

QMAX = 127
SCALE_DTYPE = torch.bfloat16
INT8PACK_K = 16  # aten._weight_int8pack_mm's in_features must be a multiple of this
BF16_GEMM_MIN_ROWS = 32  # from this many rows, a bf16 GEMM over the converted weight (see above)


@functools.cache
def native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (AVX512-BF16 or AMX tiles)."""
    cpu = getattr(torch, "cpu", None)
    checks = [getattr(cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check is not None and check() for check in checks)


def quantize_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scale bf16 [out]) with w ~ q * scale[:, None], per output row."""
    w = w.float()
    scale = (w.abs().amax(dim=1) / QMAX).clamp(min=1e-12).to(SCALE_DTYPE)  # a zero row keeps scale > 0
    q = torch.round(w / scale.float()[:, None]).clamp(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    return (q.float() * scale.float()[:, None]).to(dtype)


def int8_linear(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None = None):
    """x [..., in] @ (q * scale).T (+ bias) -> [..., out] in x's dtype."""
    if x.dim() == 2 and x.shape[0] == 1 and x.device.type == "cpu" and torch.compiler.is_compiling():
        out = ((q * x).sum(-1) * scale).unsqueeze(0)  # one vectorised pass over q (see the docstring)
    elif (x.device.type == "cpu" and not torch.compiler.is_compiling() and native_bf16()
          and x.numel() >= BF16_GEMM_MIN_ROWS * q.shape[1]):  # (a compiled step's rows are symbolic: no branch)
        rows = x.reshape(-1, q.shape[1]).to(SCALE_DTYPE)
        out = (F.linear(rows, q.to(SCALE_DTYPE)).float() * scale.float()).reshape(*x.shape[:-1], q.shape[0])
    elif x.device.type == "cpu" and q.shape[1] % INT8PACK_K == 0:
        rows = x.reshape(-1, q.shape[1]).to(SCALE_DTYPE)
        out = torch.ops.aten._weight_int8pack_mm(rows, q, scale).to(x.dtype).reshape(*x.shape[:-1], q.shape[0])
    else:
        out = F.linear(x, dequantize_int8(q, scale, x.dtype))
    out = out.to(x.dtype)
    return out if bias is None else out + bias


def weight_bytes(model: nn.Module) -> int:
    """Bytes of every parameter the model holds and of its quantized weights' scales (int8's
    per row, fp8's per row and 128 columns: buffers named *_scale), as stored; a parameter
    shared between modules counted once. Works on a meta model too."""
    scales = [t for name, t in model.named_buffers() if name.endswith("_scale")]
    return sum(t.numel() * t.element_size() for t in [*model.parameters(), *scales])
