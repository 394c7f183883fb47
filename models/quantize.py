"""`--quantization`: which weights a run stores in 8 bits, checked before any rank starts
(check) and applied on each rank after its weights are read (apply).

- fp8: float8 e4m3 weights with a float32 scale per row and 128 columns (layers/fp8_linear.py),
  made before the weights are read (prepare), so each rank's fp8 bytes are all it ever holds
  of them: an fp8 checkpoint's fp8 weights are kept as stored (block scales, or vLLM's scale
  per tensor or per channel, models/fp8_scheme.py; the ones it stores in bf16 stay float), a
  float checkpoint's are quantized as read (amax / 448 per row and 128 columns). Kept in fp8:
  the column, row and replicated linears and the MoE experts, where a shard's columns start
  on a 128 boundary
  (a row-parallel shard of in_features / tp columns needs in_features / tp % 128 == 0, an
  expert's down projection moe_intermediate / moe_tp % 128 == 0; else that weight is float);
  a checkpoint with one scale per row (per tensor or per channel) has no column blocks, so
  its row-parallel shards stay fp8 whatever their width. With static activations each fp8
  linear also keeps the checkpoint's input_scale (the Triton path quantizes by it).
  Not: the embedding, the LM head, norms, routers, MLA's kv_b_proj. Products: the block-fp8
  Triton GEMM on CUDA (activations quantized per token per 128 columns: DeepSeek-V3's
  recipe) and, for the experts, the fp8 grouped GEMM (kernels/fp8_moe.py: the same recipe over
  the routed tokens); on the CPU each product dequantizes the weight for that call
  (kernels/fp8.py), the experts' too.
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
from atoll.kernels.fp8 import GROUP
from atoll.layers import quant_linear
from atoll.layers.embedding import ParallelLMHead
from atoll.layers.fp8_linear import keep_fp8
from atoll.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear
from atoll.layers.moe import Experts
from atoll.models import build_model, fp8
from atoll.models.fp8_scheme import scheme as fp8_scheme
from atoll.parallel.mesh import ParallelContext

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


def fp8_targets(model: nn.Module, stored_fp8: set[str] | None = None) -> list[tuple[nn.Module, str, str]]:
    """(module, weight name, scale name) of every weight `--quantization fp8` keeps in fp8;
    stored_fp8: the parameters an fp8 checkpoint stores in fp8 (only those are kept: a weight
    the checkpoint left in bf16 stays float), None for a float checkpoint."""
    out = []
    per_row = _per_row(model)
    for name, m in model.named_modules():
        if isinstance(m, Experts) and (per_row or m.group.size == 1 or m.inter_local % GROUP == 0):
            out += [(m, "w13", "w13_scale"), (m, "w2", "w2_scale")]
        elif isinstance(m, RowParallelLinear) and m.group.size > 1 and m.in_local % GROUP and not per_row:
            continue  # the shard's columns start inside a 128-column block
        elif (isinstance(m, (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear))
              and name.rsplit(".", 1)[-1] not in NOT_QUANTIZED):
            out.append((m, "weight", "weight_scale"))
    if stored_fp8 is None:
        return out
    names = {id(m): name for name, m in model.named_modules()}
    return [t for t in out if f"{names[id(t[0])]}.{t[1]}".removeprefix(".") in stored_fp8]


def _scheme(model: nn.Module):
    config = getattr(model, "config", None)
    return fp8_scheme(getattr(config, "raw", None) or {})


def _per_row(model: nn.Module) -> bool:
    """Whether the model's checkpoint stores fp8 weights with a scale per tensor or per row."""
    s = _scheme(model)
    return s is not None and s.block is None


def stored_fp8(model: nn.Module, ckpt) -> set[str] | None:
    """The parameters that receive an fp8 tensor of `ckpt`; None when it stores none."""
    out = set()
    for name in ckpt.names():
        if ckpt.dtype(name) in fp8.FP8_DTYPES:
            out |= {target for target, _ in model.checkpoint_targets(name)}
    return out or None


def prepare(model: nn.Module, method: str | None, ckpt=None) -> int:
    """Before the weights are read from `ckpt`: the parameters `method` stores in another
    dtype are made so (fp8); returns how many."""
    if method != "fp8":
        return 0
    targets = fp8_targets(model, stored_fp8(model, ckpt) if ckpt is not None else None)
    scheme = _scheme(model)
    static = scheme is not None and scheme.static_inputs
    for m, weight, scale in targets:
        keep_fp8(m, weight, scale, "input_scale" if static and weight == "weight" else None)
    return len(targets)


def rank_weight_bytes(config, layout, rank: int, *, dtype: torch.dtype, quantization: str | None,
                      ckpt=None) -> int:
    """The weight bytes rank `rank` of `layout` holds after loading, as the runner makes them
    (build_model, prepare, apply), counted on a meta model: parameters and quantization
    scales (layers.quant_linear.weight_bytes)."""
    model = build_model(config, ParallelContext.detached(layout, rank, device="meta"), dtype=dtype, device="meta")
    prepare(model, quantization, ckpt)
    apply(model, quantization)
    return quant_linear.weight_bytes(model)


def _on_cuda(device: str) -> bool:
    return device == "cuda" or (device == "auto" and torch.cuda.is_available())


def check(method: str | None, config, device: str) -> None:
    """One InputError line when `method` cannot run on this model and device."""
    if method == "fp8":
        block = (getattr(config, "raw", None) or {}).get("quantization_config", {}).get("weight_block_size")
        if block is not None and block[1] != GROUP:
            raise InputError(f"--quantization fp8 keeps {GROUP}-column scale blocks; this checkpoint's "
                             f"weight_block_size is {block}: drop --quantization to load it dequantized")
    if method == "int8" and _on_cuda(device):
        raise InputError("--quantization int8 is weight-only int8 for the CPU (torch's int8 weight-only "
                         "kernel); run it with --device cpu, or use --quantization fp8 on GPUs")


def apply(model, method: str | None) -> int:
    """Quantizes the rank's loaded model in place; returns the number of weights changed."""
    if method is None:
        return 0
    if method == "int8":
        return quantize_model_int8(model)
    return 0  # fp8: made by prepare, filled by the loaders
