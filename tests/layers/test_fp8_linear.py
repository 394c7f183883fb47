"""What a layer keeps beside its parameters, explicitly: an fp8 weight's scales in the layer's
fp8_scales (keep_fp8 returns them; the layer's weight_loader hands them to copy_into), and the
checkpoint shard ids a merged parameter is filled from in its shard_ids, which the strict
loader checks (models/strict.py)."""

import pytest
import torch

from atoll.kernels.fp8 import FP8, dequantize_weight
from atoll.layers.fp8_linear import keep_fp8
from atoll.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, copy_into
from atoll.models.strict import shard_ids
from atoll.parallel.mesh import ParallelContext


def _merged() -> MergedColumnParallelLinear:
    return MergedColumnParallelLinear(256, [64, 64], ParallelContext.single().tp)


def test_the_loader_writes_an_fp8_weight_with_the_scales_its_layer_keeps():
    layer = _merged()
    scales = keep_fp8(layer, "weight", "weight_scale")
    assert layer.fp8_scales == {"weight": scales} and scales.scale is layer.weight_scale
    assert layer.weight.dtype == FP8 and scales.shape == (128, 256) and scales.input is None
    up = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    layer.weight.weight_loader(layer.weight, up, 1)  # the second part: rows 64..127
    assert torch.equal(layer.weight_scale[:64], torch.ones(64, 2))  # the first part's rows untouched
    got = dequantize_weight(layer.weight[64:], layer.weight_scale[64:])
    torch.testing.assert_close(got, up, rtol=0.07, atol=1e-3)  # e4m3: 3 mantissa bits


def test_an_fp8_parameter_without_scales_is_refused():
    with pytest.raises(ValueError, match="without its scales"):
        copy_into(torch.empty(4, 128, dtype=FP8), torch.randn(4, 128))


def test_merged_layers_declare_the_shards_each_parameter_needs():
    tp = ParallelContext.single().tp
    model = torch.nn.ModuleDict({"gate_up": _merged(), "qkv": QKVParallelLinear(32, 8, 4, 2, tp, bias=True)})
    assert model["gate_up"].shard_ids == {"weight": (0, 1)}
    assert shard_ids(model, "gate_up.weight") == (0, 1)
    assert shard_ids(model, "qkv.weight") == shard_ids(model, "qkv.bias") == ("q", "k", "v")
    keep_fp8(model["gate_up"], "weight", "weight_scale")  # the parameter replaced: its shards stay the layer's
    assert shard_ids(model, "gate_up.weight") == (0, 1)
    assert not any(hasattr(p, "shards") for p in model.parameters())
