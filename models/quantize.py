"""`--quantization`: which weights a run stores in 8 bits, checked before any rank starts
(check) and applied on each rank after its weights are read (apply).

- int8: weight-only int8 rows with a bf16 scale each, quantized from the loaded weights
  (layers/quant_linear.py); the CPU runs them through torch's int8 weight-only kernel. Refused
  on CUDA (that kernel is the CPU's). Quantized: the column, row and replicated linears and
  the LM head. Not: the embedding (a lookup reads a few rows), norms, routers, MoE experts,
  and MLA's kv_b_proj (the absorbed decode reads its weight as floats).
"""

from __future__ import annotations

import torch
from torch import nn

from atoll.errors import InputError
from atoll.layers import quant_linear
from atoll.layers.embedding import ParallelLMHead
from atoll.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

NOT_QUANTIZED = ("kv_b_proj",)  # module names whose weight other code reads as floats


def quantizable(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of every linear `--quantization int8` stores in int8."""
    kinds = (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear, ParallelLMHead)
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, kinds) and name.rsplit(".", 1)[-1] not in NOT_QUANTIZED and m.weight.dim() == 2]


def quantize_model_int8(model: nn.Module) -> int:
    """Replaces each quantizable linear's float weight by its int8 rows and bf16 scales (the
    float copy is freed); returns the number of weights quantized. A weight tied to another
    module (an embedding) keeps its float tensor there."""
    done = 0
    for _, m in quantizable(model):
        q, scale = quant_linear.quantize_int8(m.weight.data)
        m.weight = nn.Parameter(q.to(m.weight.device), requires_grad=False)
        m.weight_scale = scale.to(m.weight.device)
        done += 1
    return done


def _on_cuda(device: str) -> bool:
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def check(method: str | None, config, device: str) -> None:
    """One InputError line when `method` cannot run on this model and device."""
    if method == "int8" and _on_cuda(device):
        raise InputError("--quantization int8 is weight-only int8 for the CPU (torch's int8 weight-only "
                         "kernel); run it with --device cpu, or use --quantization fp8 on GPUs")


def apply(model, method: str | None) -> int:
    """Quantizes the rank's loaded model in place; returns the number of weights changed."""
    if method is None:
        return 0
    if method == "int8":
        return quantize_model_int8(model)
    raise InputError(f"--quantization {method} is not supported here")
