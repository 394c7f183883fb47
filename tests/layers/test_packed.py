"""Packed decode weights. MKL's (opt-in: the config's mkl_pack, env ATOLL_MKL_PACK=1): F.linear to float32 tolerance (bit
for bit on some CPUs, not on every one), packed only for a batch size that persists. oneDNN's for the eager step
(engine.rank.tuning.tune_eager): only the shapes measured faster, only for short products, never under --enforce-eager
(--compile never: no compile, tuned products)."""

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from atoll.layers import packed

pytestmark = pytest.mark.skipif(not packed.mkl_can_pack(), reason="torch without MKL packed GEMM")


def test_packed_linear_is_f_linear():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    packer = packed.Packer([w])
    packer.pack(5)
    assert w.packed[0] == 5
    for rows in (1, 5, 7):  # 5 runs packed, the others fall back to F.linear
        x = torch.randn(rows, 40, generator=g)
        if rows == 5:  # MKL's packed GEMM may sum in another order than its plain one
            torch.testing.assert_close(packed.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(packed.linear(x, w, b), F.linear(x, w, b))


def test_packs_after_a_size_persists_and_only_float32_cpu_weights():
    w32, w16 = torch.randn(8, 4), torch.randn(8, 4, dtype=torch.bfloat16)
    packer = packed.Packer([w32, w16], patience=3)
    assert packer.weights == [w32]
    for rows in (4, 4, 2, 4, 4):  # a change of size restarts the count
        packer.observe(rows)
    assert packer.rows is None
    packer.observe(4)
    assert packer.rows == 4 and w32.packed[0] == 4 and not hasattr(w16, "packed")
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
    a, b, c = torch.randn(96, 40, generator=g), torch.randn(96, 40, generator=g), torch.randn(24, 96, generator=g)
    monkeypatch.setattr(packed, "TUNE_MARGIN", margin)  # inf: any packed product wins; 0: none does
    done = packed.tune_onednn([a, b, c], rows=4)
    assert done["weights"] == 3 and done["packed"] == 3 * expect // 2 and done["plain_s"] > 0
    assert [getattr(w, "onednn_eager", False) for w in (a, b, c)] == [bool(expect)] * 3
    bias = torch.randn(96, generator=g)
    for rows in (1, 4, packed.EAGER_MAX_ROWS):
        x = torch.randn(rows, 40, generator=g)
        torch.testing.assert_close(packed.linear(x, a, bias), F.linear(x, a, bias), rtol=1e-5, atol=1e-5)
    long = torch.randn(packed.EAGER_MAX_ROWS + 1, 40, generator=g)  # a long prefill: F.linear itself
    assert torch.equal(packed.linear(long, a, bias), F.linear(long, a, bias))


class _Stage(torch.nn.Sequential):
    """A one-layer stage that names its linear weights, as a model does (linear_weights)."""

    def linear_weights(self):
        return [self[0].weight]


def _runner(**engine):
    from atoll.config import EngineConfig
    from atoll.layers.linear import ReplicatedLinear

    layer = ReplicatedLinear(40, 96)
    model = _Stage(layer)
    spec = SimpleNamespace(engine=EngineConfig(**engine), cache_seqs=4, decode_steps=None)
    return SimpleNamespace(spec=spec, model=model, device=torch.device("cpu"), ranks_here=1, spec_k=None,
                           ctx=SimpleNamespace(rank=0)), layer.weight


@onednn
@pytest.mark.parametrize("options, tuned", [({}, True), ({"enforce_eager": True}, False),
                                            ({"compile": "never"}, True), ({"compile_freezing": False}, False)])
def test_eager_step_tunes_unless_told_not_to(monkeypatch, capsys, options, tuned):
    from atoll.engine.rank.tuning import tune_eager

    monkeypatch.setattr(packed, "TUNE_MARGIN", float("inf"))
    runner, weight = _runner(**options)
    tune_eager(runner)
    assert getattr(weight, "onednn_eager", False) is tuned
    assert ("1 of 1 weights packed for oneDNN" in capsys.readouterr().err) is tuned


@onednn
def test_a_job_too_short_to_repay_the_tuning_is_not_tuned(monkeypatch):
    from atoll.engine.rank.tuning import tune_eager

    monkeypatch.setattr(packed, "TUNE_MARGIN", float("inf"))
    for steps, tuned in ((packed.TUNE_MIN_STEPS - 1, False), (packed.TUNE_MIN_STEPS, True), (None, True)):
        runner, weight = _runner()
        runner.spec.decode_steps = steps
        tune_eager(runner)
        assert getattr(weight, "onednn_eager", False) is tuned
