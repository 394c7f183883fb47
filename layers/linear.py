"""Tensor-parallel linear layers, built already sharded.

Each weight carries a `weight_loader(param, src, shard=None)` that reads only this rank's
slice from `src`, a lazy checkpoint tensor (safetensors slice) indexed like a tensor.
Weights follow torch's [out_features, in_features] convention.

What a layer holds besides its parameters, each explicit on the layer:
- `packs` (layers.packed.Packs): its weight's packed copies for CPU products, handed to
  `linear` with the weight;
- `fp8_scales`: parameter name -> layers.fp8_linear.Fp8Scales, for a weight kept in fp8
  (keep_fp8 fills it), which the layer's weight_loader hands to copy_into;
- `shard_ids` (the merged layers): parameter name -> the checkpoint shard ids it is filled
  from, which models/strict.py checks were all loaded (a parameter not named: one tensor).
"""

from __future__ import annotations

import torch
from torch import nn

from atoll.comm.group import Group
from atoll.layers import fp8_linear
from atoll.layers.packed import Packs, linear


def divide(n: int, d: int, what: str = "size") -> int:
    if n % d:
        raise ValueError(f"{what}={n} is not divisible by {d}")
    return n // d


def kv_heads_per_rank(num_kv_heads: int, tp: int) -> int:
    """KV heads each rank holds: a 1/tp share, or one replicated head when kv_heads < tp."""
    return max(1, num_kv_heads // tp)


def _param(*shape, dtype=None) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype or torch.get_default_dtype()), requires_grad=False)


def copy_into(dst: torch.Tensor, src: torch.Tensor, fp8: fp8_linear.Fp8Scales | None = None) -> None:
    """dst (a slice of a parameter) = src; a parameter kept in fp8 is written with its scales,
    `fp8` (fp8_linear.scales_of: the parameter's entry in its layer's fp8_scales)."""
    if tuple(dst.shape) != tuple(src.shape):
        raise ValueError(f"shape mismatch: parameter slice {tuple(dst.shape)} vs checkpoint {tuple(src.shape)}")
    if fp8_linear.is_fp8(dst):  # a weight kept in fp8: its scales are written beside it
        if fp8 is None:
            raise ValueError("an fp8 parameter without its scales (one keep_fp8 did not make)")
        fp8_linear.write(dst, src, fp8)
    else:
        dst.copy_(src)


class ColumnParallelLinear(nn.Module):
    """y[:, out/tp] = x[:, in] W[out/tp, in]^T; no collective (the next RowParallel reduces)."""

    def __init__(self, in_features: int, out_features: int, group: Group, *, bias: bool = False, dtype=None):
        super().__init__()
        self.group = group
        self.in_features = in_features
        self.out_local = divide(out_features, group.size, "out_features")
        self.weight = _param(self.out_local, in_features, dtype=dtype)
        self.weight.weight_loader = self._load_rows
        self.register_buffer("weight_scale", None)  # int8 weights' per-row scales (layers.quant_linear)
        self.register_buffer("input_scale", None)  # an fp8 checkpoint's static activation scale
        self.fp8_scales: dict[str, fp8_linear.Fp8Scales] = {}
        self.packs = Packs()
        self.bias = None
        if bias:
            self.bias = _param(self.out_local, dtype=dtype)
            self.bias.weight_loader = self._load_rows

    def _load_rows(self, param, src, shard=None):
        start = self.group.rank * self.out_local
        copy_into(param.data, src[start:start + self.out_local], fp8_linear.scales_of(self, param))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.weight_scale, self.input_scale,
                      packs=self.packs)  # [tokens, out/tp]


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs in one weight (gate and up): each rank holds its
    slice of every part, concatenated: [gate/tp ; up/tp]."""

    def __init__(self, in_features: int, out_sizes: list[int], group: Group, *, bias: bool = False, dtype=None):
        self.part_local = [divide(n, group.size, "out_features") for n in out_sizes]
        super().__init__(in_features, sum(out_sizes), group, bias=bias, dtype=dtype)
        self.shard_ids = {name: tuple(range(len(out_sizes))) for name, _ in self.named_parameters()}

    def _load_rows(self, param, src, shard: int = 0):
        n = self.part_local[shard]
        offset = sum(self.part_local[:shard])
        start = self.group.rank * n
        copy_into(param.data[offset:offset + n], src[start:start + n], fp8_linear.scales_of(self, param))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k, v projections in one weight, split by heads. When kv_heads < tp each KV head
    is replicated on tp/kv_heads ranks (rank r holds KV head r // (tp/kv_heads))."""

    def __init__(self, hidden: int, head_dim: int, num_heads: int, num_kv_heads: int, group: Group,
                 *, bias: bool = False, dtype=None):
        tp = group.size
        self.head_dim = head_dim
        self.heads_local = divide(num_heads, tp, "num_attention_heads")
        self.kv_local = kv_heads_per_rank(num_kv_heads, tp)
        if num_kv_heads >= tp:
            divide(num_kv_heads, tp, "num_key_value_heads")
            self.kv_start = group.rank * self.kv_local
        else:
            self.kv_start = group.rank // divide(tp, num_kv_heads, "tp over num_key_value_heads")
        self.q_size = self.heads_local * head_dim
        self.kv_size = self.kv_local * head_dim
        out_total = (self.heads_local + 2 * self.kv_local) * head_dim * tp
        super().__init__(hidden, out_total, group, bias=bias, dtype=dtype)
        self.shard_ids = {name: ("q", "k", "v") for name, _ in self.named_parameters()}

    def _load_rows(self, param, src, shard: str = "q"):
        if shard == "q":
            offset, n, start = 0, self.q_size, self.group.rank * self.q_size
        else:
            offset = self.q_size + (self.kv_size if shard == "v" else 0)
            n, start = self.kv_size, self.kv_start * self.head_dim
        copy_into(param.data[offset:offset + n], src[start:start + n], fp8_linear.scales_of(self, param))

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)


class RowParallelLinear(nn.Module):
    """y[:, out] = sum over tp of x[:, in/tp] W[out, in/tp]^T: one all_reduce."""

    def __init__(self, in_features: int, out_features: int, group: Group, *, bias: bool = False, dtype=None):
        super().__init__()
        self.group = group
        self.in_local = divide(in_features, group.size, "in_features")
        self.weight = _param(out_features, self.in_local, dtype=dtype)
        self.weight.weight_loader = self._load_cols
        self.register_buffer("weight_scale", None)  # int8 weights' per-row scales (layers.quant_linear)
        self.register_buffer("input_scale", None)  # an fp8 checkpoint's static activation scale
        self.fp8_scales: dict[str, fp8_linear.Fp8Scales] = {}
        self.packs = Packs()
        self.bias = None
        if bias:  # added once, after the reduction
            self.bias = _param(out_features, dtype=dtype)
            self.bias.weight_loader = lambda p, src, shard=None: copy_into(p.data, src[:])

    def _load_cols(self, param, src, shard=None):
        start = self.group.rank * self.in_local
        copy_into(param.data, src[:, start:start + self.in_local], fp8_linear.scales_of(self, param))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.group.all_reduce(linear(x, self.weight, scale=self.weight_scale, input_scale=self.input_scale,
                                         packs=self.packs))
        return y if self.bias is None else y + self.bias


class ReplicatedLinear(nn.Module):
    """The full weight on every rank (routers, small projections)."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool = False, dtype=None):
        super().__init__()
        self.weight = _param(out_features, in_features, dtype=dtype)
        self.weight.weight_loader = self._load
        self.register_buffer("weight_scale", None)  # int8 weights' per-row scales (layers.quant_linear)
        self.register_buffer("input_scale", None)  # an fp8 checkpoint's static activation scale
        self.fp8_scales: dict[str, fp8_linear.Fp8Scales] = {}
        self.packs = Packs()
        self.bias = None
        if bias:
            self.bias = _param(out_features, dtype=dtype)
            self.bias.weight_loader = lambda p, src, shard=None: copy_into(p.data, src[:])

    def _load(self, param, src, shard=None):
        copy_into(param.data, src[:], fp8_linear.scales_of(self, param))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias, self.weight_scale, self.input_scale, packs=self.packs)
