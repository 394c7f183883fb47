"""fp8 weights kept in fp8 (`--quantization fp8`): a parameter turned into float8 e4m3 with a
float32 scale per row and 128 columns beside it (kernels/fp8.py's layout), filled by the
layers' own weight_loaders through `linear.copy_into`, which hands an fp8 destination here.

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

import weakref

import torch
from torch import nn

from atoll.kernels.fp8 import FP8, dequantize_weight, groups, quantize_weight

# the fp8 parameter's storage -> (its shape, its scale tensor, its static input scale or None):
# copy_into finds a destination view's scale rows from the view's storage and offset
_SCALES: dict[int, tuple[torch.Size, torch.Tensor, torch.Tensor | None]] = {}


def keep_fp8(module: nn.Module, name: str, scale_name: str, input_name: str | None = None) -> None:
    """Replaces module.<name> (a float parameter [..., rows, cols], not loaded yet) by an fp8
    one of the same shape, and sets module.<scale_name> to its float32 scales [..., rows,
    groups] and, given input_name, module.<input_name> to its static input scale (a float32
    scalar, filled from the checkpoint); the weight_loader and shards attributes carry over."""
    old = getattr(module, name)
    new = nn.Parameter(torch.empty(old.shape, dtype=FP8, device=old.device), requires_grad=False)
    for attr in ("weight_loader", "shards"):
        if hasattr(old, attr):
            setattr(new, attr, getattr(old, attr))
    setattr(module, name, new)
    scale = torch.ones(*old.shape[:-1], groups(old.shape[-1]), dtype=torch.float32, device=old.device)
    setattr(module, scale_name, scale)
    inp = None
    if input_name is not None:
        inp = torch.zeros((), dtype=torch.float32, device=old.device)
        setattr(module, input_name, inp)
    if new.is_meta:  # a model built to count its bytes: never loaded
        return
    key = new.untyped_storage().data_ptr()
    _SCALES[key] = (new.shape, scale, inp)
    weakref.finalize(new, _SCALES.pop, key, None)


def is_fp8(t: torch.Tensor) -> bool:
    return t.dtype == FP8


def write(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst (whole rows of a keep_fp8 parameter) = src, with the rows' scales."""
    entry = _SCALES.get(dst.untyped_storage().data_ptr())
    if entry is None:
        raise ValueError("an fp8 parameter that keep_fp8 did not make")
    shape, scale, inp = entry
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
    """A keep_fp8 parameter of any rank as float (for paths without an fp8 kernel: experts)."""
    cols = w.shape[-1]
    flat = dequantize_weight(w.reshape(-1, cols), scale.reshape(-1, scale.shape[-1]))
    return flat.view(w.shape).to(dtype)
