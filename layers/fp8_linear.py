"""fp8 weights kept in fp8 (`--quantization fp8`): a parameter turned into float8 e4m3 with a
float32 scale per row and 128 columns beside it (kernels/fp8.py's layout), filled by the
layers' own weight_loaders through `linear.copy_into`, which hands an fp8 destination here
with its Fp8Scales (the layer's fp8_scales entry for that parameter).

A checkpoint's 128 x 128 block scale is repeated over the block's rows, so a rank's slice may
start inside a block (a TP shard of 64 rows, a merged [gate; up] or an expert's moe_tp rows)
and still keep the checkpoint's fp8 values as stored: 4 bytes of scale per row and 128
columns (3% over the fp8 bytes) buy that freedom. Columns must start on a 128 boundary; the
callers (models/quantize.py) keep a weight in float where a shard's columns would not.

Sources written into an fp8 destination:
- a raw fp8 slice of a block-fp8 checkpoint (models.fp8.Fp8Source.raw): copied as stored;
- a raw fp8 slice of a per-tensor or per-channel checkpoint (models.fp8.ChannelFp8Source.raw):
  copied as stored, its rows' scale repeated over their 128-column groups (so any first
  column will do); its static input scale, if any, goes to the module's `input_scale`: the
  largest of the parts' (a merged [q; k; v] or [gate; up] quantizes its one input once, as
  vLLM does);
- a float slice (a bf16 or float32 checkpoint: online quantization): quantized per row and
  128 columns, scale = amax / 448.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from atoll.kernels.fp8 import FP8, dequantize_weight, groups, quantize_weight


@dataclass(eq=False)
class Fp8Scales:
    """What `write` needs beside an fp8 parameter made by keep_fp8: the parameter's shape, its
    float32 scales [..., rows, groups] and its static input scale (a float32 scalar; None
    where the checkpoint's activations are dynamic). The layer keeps it in its fp8_scales, under
    the parameter's name, and its weight_loader hands it to layers.linear.copy_into."""

    shape: torch.Size
    scale: torch.Tensor
    input: torch.Tensor | None


def keep_fp8(module: nn.Module, name: str, scale_name: str, input_name: str | None = None) -> Fp8Scales:
    """Replaces module.<name> (a float parameter [..., rows, cols], not loaded yet) by an fp8
    one of the same shape, and sets module.<scale_name> to its float32 scales [..., rows,
    groups] and, given input_name, module.<input_name> to its static input scale (a float32
    scalar, filled from the checkpoint); the weight_loader carries over. The scales go to
    module.fp8_scales[name] (a layer that may keep fp8 weights declares that dict) and are
    returned."""
    old = getattr(module, name)
    new = nn.Parameter(torch.empty(old.shape, dtype=FP8, device=old.device), requires_grad=False)
    if hasattr(old, "weight_loader"):
        new.weight_loader = old.weight_loader
    setattr(module, name, new)
    scale = torch.ones(*old.shape[:-1], groups(old.shape[-1]), dtype=torch.float32, device=old.device)
    setattr(module, scale_name, scale)
    inp = None
    if input_name is not None:
        inp = torch.zeros((), dtype=torch.float32, device=old.device)
        setattr(module, input_name, inp)
    module.fp8_scales[name] = scales = Fp8Scales(new.shape, scale, inp)
    return scales


def scales_of(module: nn.Module, param: torch.Tensor) -> Fp8Scales | None:
    """The Fp8Scales keep_fp8 recorded for `param`, one of module's own parameters; None for a
    parameter not kept in fp8."""
    for name, scales in module.fp8_scales.items():
        if getattr(module, name) is param:
            return scales
    return None


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8


def write(dst: torch.Tensor, src: torch.Tensor, fp8: Fp8Scales) -> None:
    """dst (whole rows of a keep_fp8 parameter, as a view of it: its offset says which rows)
    = src, with the rows' scales into fp8.scale."""
    shape, scale, inp = fp8.shape, fp8.scale, fp8.input
    cols = shape[-1]
    if dst.shape[-1] != cols or not dst.is_contiguous():
        raise ValueError(f"an fp8 weight is written by whole rows, not a {tuple(dst.shape)} slice of {tuple(shape)}")
    first, rows = dst.storage_offset() // cols, dst.numel() // cols
    raw = getattr(src, "fp8_scale", None)
    if raw is not None:
        q, s = src.reshape(rows, cols), raw.reshape(rows, -1)
    else:
        q, s = quantize_weight(src.reshape(rows, cols).to(dst.device))
    dst.copy_(q.view(dst.shape))
    scale.view(-1, scale.shape[-1])[first:first + rows] = s.to(scale.device)
    static = getattr(src, "fp8_input_scale", None)
    if static is not None and inp is not None:
        inp.copy_(torch.maximum(inp, static.to(inp.device)))


def dequantized(w: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A keep_fp8 parameter of any rank as float (the experts' torch path, on the CPU)."""
    cols = w.shape[-1]
    flat = dequantize_weight(w.reshape(-1, cols), scale.reshape(-1, scale.shape[-1]))
    return flat.view(w.shape).to(dtype)
