"""Packed decode weights. MKL's (opt-in: the config's mkl_pack, env ATOLL_MKL_PACK=1): F.linear to float32 tolerance (bit
for bit on some CPUs, not on every one), packed only for a batch size that persists. oneDNN's for the eager step
(engine.rank.tuning.tune_eager): only the shapes measured faster, only for short products, never under --enforce-eager
(--compile never: no compile, tuned products)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from atoll.layers import packed
from atoll.layers.linear import ReplicatedLinear

pytestmark = pytest.mark.skipif(not packed.mkl_can_pack(), reason="torch without MKL packed GEMM")


def _layer(out_features: int, in_features: int, generator=None, dtype=torch.float32) -> ReplicatedLinear:
    """A linear layer holding a random weight (and its empty Packs)."""
    layer = ReplicatedLinear(in_features, out_features, dtype=dtype)
    layer.weight.data.copy_(torch.randn(out_features, in_features, generator=generator))
    return layer


def test_packed_linear_is_f_linear():
    g = torch.Generator().manual_seed(0)
    layer, b = _layer(96, 40, g), torch.randn(96, generator=g)
    w = layer.weight
    packer = packed.Packer([layer])
    packer.pack(5)
    assert layer.packs.mkl[0] == 5  # the copy is the layer's; the weight tensor carries nothing
    assert not hasattr(w, "packed")
    for rows in (1, 5, 7):  # 5 runs packed, the others fall back to F.linear
        x = torch.randn(rows, 40, generator=g)
        got = packed.linear(x, w, b, packs=layer.packs)
        if rows == 5:  # MKL's packed GEMM may sum in another order than its plain one
            torch.testing.assert_close(got, F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(got, F.linear(x, w, b))


def test_packs_after_a_size_persists_and_only_float32_cpu_weights():
    l32, l16 = _layer(8, 4), _layer(8, 4, dtype=torch.bfloat16)
    packer = packed.Packer([l32, l16], patience=3)
    assert packer.layers == [l32]
    for rows in (4, 4, 2, 4, 4):  # a change of size restarts the count
        packer.observe(rows)
    assert packer.rows is None and l32.packs.mkl is None
    packer.observe(4)
    assert packer.rows == 4 and l32.packs.mkl[0] == 4 and l16.packs.mkl is None
    packer.observe(4)  # already packed for 4: nothing to do
    assert packer.rows == 4


def test_off_unless_asked_for():
    from atoll.config import resolve

    assert resolve(environ={}).mkl_pack is False
    assert resolve(environ={"ATOLL_MKL_PACK": "1"}).mkl_pack is True
    assert resolve(environ={"ATOLL_MKL_PACK": "0"}).mkl_pack is False


onednn = pytest.mark.skipif(not packed.onednn_can_pack(), reason="torch without oneDNN packed linear")


@onednn
@pytest.mark.parametrize("margin, expect", [(float("inf"), 2), (0.0, 0)])
def test_tuning_packs_the_shapes_measured_faster(monkeypatch, margin, expect):
    g = torch.Generator().manual_seed(0)
    a, b, c = _layer(96, 40, g), _layer(96, 40, g), _layer(24, 96, g)
    monkeypatch.setattr(packed, "TUNE_MARGIN", margin)  # inf: any packed product wins; 0: none does
    done = packed.tune_onednn([a, b, c], rows=4)
    assert done["weights"] == 3 and done["packed"] == 3 * expect // 2 and done["plain_s"] > 0
    assert [m.packs.in_eager for m in (a, b, c)] == [bool(expect)] * 3
    assert [m.packs.onednn_copy is not None for m in (a, b, c)] == [bool(expect)] * 3
    w, bias = a.weight, torch.randn(96, generator=g)
    for rows in (1, 4, packed.EAGER_MAX_ROWS):
        x = torch.randn(rows, 40, generator=g)
        torch.testing.assert_close(packed.linear(x, w, bias, packs=a.packs), F.linear(x, w, bias),
                                   rtol=1e-5, atol=1e-5)
    long = torch.randn(packed.EAGER_MAX_ROWS + 1, 40, generator=g)  # a long prefill: F.linear itself
    assert torch.equal(packed.linear(long, w, bias, packs=a.packs), F.linear(long, w, bias))


class _Stage(torch.nn.Sequential):
    """A one-layer stage that names its linear layers, as a model does (linear_layers)."""

    def linear_layers(self):
        return [self[0]]


def _runner(**engine):
    from atoll.config import EngineConfig

    layer = ReplicatedLinear(40, 96)
    model = _Stage(layer)
    spec = SimpleNamespace(engine=EngineConfig(**engine), cache_seqs=4, decode_steps=None)
    return SimpleNamespace(spec=spec, model=model, device=torch.device("cpu"), ranks_here=1, spec_k=None,
                           ctx=SimpleNamespace(rank=0)), layer


@onednn
@pytest.mark.parametrize("options, tuned", [({}, True), ({"enforce_eager": True}, False),
                                            ({"compile": "never"}, True), ({"compile_freezing": False}, False)])
def test_eager_step_tunes_unless_told_not_to(monkeypatch, capsys, options, tuned):
    from atoll.engine.rank.tuning import tune_eager

    monkeypatch.setattr(packed, "TUNE_MARGIN", float("inf"))
    runner, layer = _runner(**options)
    tune_eager(runner)
    assert layer.packs.in_eager is tuned and (layer.packs.onednn_copy is not None) is tuned
    assert ("1 of 1 weights packed for oneDNN" in capsys.readouterr().err) is tuned


@onednn
def test_a_job_too_short_to_repay_the_tuning_is_not_tuned(monkeypatch):
    from atoll.engine.rank.tuning import tune_eager

    monkeypatch.setattr(packed, "TUNE_MARGIN", float("inf"))
    for steps, tuned in ((packed.TUNE_MIN_STEPS - 1, False), (packed.TUNE_MIN_STEPS, True), (None, True)):
        runner, layer = _runner()
        runner.spec.decode_steps = steps
        tune_eager(runner)
        assert layer.packs.in_eager is tuned


@onednn
@pytest.mark.skipif(not packed.COMPILED_ONEDNN, reason="torch without opaque objects for custom ops")
def test_a_compiled_graph_takes_each_layers_own_copy(monkeypatch, tmp_path):
    """The compiled step's products: one graph serves every layer of a shape, each call handed
    the copy its layer holds (an opaque graph input, not a lookup), the product matching F.linear."""
    from torch._dynamo.utils import counters
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    g = torch.Generator().manual_seed(0)
    layers = [_layer(96, 40, g) for _ in range(2)]
    assert packed.pack_onednn(layers) == 2
    assert all(isinstance(m.packs.onednn_copy, packed.OnednnWeight) and not m.packs.in_eager for m in layers)
    seen, product = [], packed._onednn_product

    def spy(x, weight, bias, copy):
        seen.append(copy)
        return product(x, weight, bias, copy)

    monkeypatch.setattr(packed, "_onednn_product", spy)

    def step(layer, x):
        return layer(x)

    compiled = torch.compile(step, dynamic=False, fullgraph=True)
    graphs = counters["stats"]["unique_graphs"]
    with temporary_cache_dir(str(tmp_path)):
        for rows in (3, 5):
            x = torch.randn(rows, 40, generator=g)
            torch._dynamo.mark_dynamic(x, 0, min=2, max=8)
            for m in layers:
                torch.testing.assert_close(compiled(m, x), F.linear(x, m.weight), rtol=1e-5, atol=1e-5)
    assert counters["stats"]["unique_graphs"] - graphs == 1
    own = [layers[0].packs.onednn_copy, layers[1].packs.onednn_copy] * 2
    assert len(seen) == len(own) and all(a is b for a, b in zip(seen, own))
