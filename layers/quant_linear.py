"""Weight-only int8 linears (`--quantization int8`): each output row of a weight is stored as
int8 with one bfloat16 scale, w[o, :] ~ q[o, :] * scale[o] (symmetric, scale = amax / 127,
rounded to bf16 before the rows are rounded, so q * scale is exactly what the kernels
multiply by). Activations stay in the compute dtype.

Products (layers.packed.linear sends a weight that has a scale here):
- inside the compiled CPU decode step at one row: the row reduction (q * x).sum(-1) * scale,
  which inductor turns into one vectorised pass over the int8 weight with float32 sums;
- everywhere else on the CPU: torch's int8 weight-only kernel, aten._weight_int8pack_mm,
  on bfloat16 activations (its float32 path is a slow loop; bfloat16 is its fast one), the
  output cast back to the compute dtype. It needs in_features % 16 == 0 (it crashes or is
  wrong otherwise); other widths multiply by the dequantized weight.

Which weights are quantized: models/quantize.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

QMAX = 127
SCALE_DTYPE = torch.bfloat16
INT8PACK_K = 16  # aten._weight_int8pack_mm's in_features must be a multiple of this


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
