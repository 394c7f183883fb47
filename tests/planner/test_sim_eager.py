"""Measured steps as the compiled CPU step runs them. Decode ticks it leaves to the eager step:
a long sequence decoding beside short ones splits its rows into context groups
(layers.context_groups), which the engine runs eagerly; a calibration that measured such ticks
beside compiled ones times them as the plain step (StepFit.eager_decode), and the simulator does
so for the ticks whose rows split. And its row buckets: 17 rows run as 32 (StepFit.decode_rows)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from atoll.planner.sim.api import Deployment, prepare, simulate
from atoll.planner.sim.load import BenchRequest
from atoll.planner.sim.stepfit import StepFit, fit, row_bucket
from atoll.topologies import load_topology
from atoll.topologies.calibration import Calibration

MODEL = "Llama-3.1-8B"


def graphed(r: int) -> float:
    """A compiled decode tick: 20 ms + 1 ms a row."""
    return 1e-3 * (20 + r)


def plain(r: int, c: int) -> float:
    """A tick of the plain step: 30 ms + 3 ms a row + 0.05 ms a chunk token."""
    return 1e-3 * (30 + 3 * r + 0.05 * c)


def _samples(flags: bool = True) -> list[tuple]:
    out = []
    for r in (1, 2, 4, 8, 16):
        out.append((r, 0, 100.0 * r, 0.0, graphed(r), 128.0 * r) + ((True,) if flags else ()))
        out.append((r, 0, 900.0 * r, 0.0, plain(r, 0), 1024.0 * r) + ((False,) if flags else ()))
        for c in (64, 512):
            out.append((r, c, 100.0 * r, 10.0 * c, plain(r, c), 128.0 * r) + ((False,) if flags else ()))
    return out


def test_eager_decode_ticks_are_fitted_as_the_plain_step():
    f = fit(_samples())
    assert f.eager_decode
    for r in (1, 3, 8):
        assert f.seconds(r, 0, 100.0 * r, 0.0, 128.0 * r) == pytest.approx(graphed(r), rel=1e-3)
        assert f.seconds(r, 0, 900.0 * r, 0.0, 1024.0 * r, split=True) == pytest.approx(plain(r, 0), rel=1e-3)
        assert f.seconds(r, 64, 100.0 * r, 640.0) == pytest.approx(plain(r, 64), rel=1e-3)
    back = StepFit.from_dict(f.to_dict(), "x")
    assert back.eager_decode and back.seconds(2, 0, 1800.0, 0.0, split=True) == pytest.approx(plain(2, 0), rel=1e-3)
    # ticks without the flag (a calibration written before it): one decode part, as before
    assert not fit(_samples(flags=False)).eager_decode
    assert not StepFit.from_dict({k: v for k, v in f.to_dict().items() if k != "eager_decode"}, "x").eager_decode


@pytest.mark.parametrize("eager", [True, False])
def test_the_simulator_times_split_decode_ticks_as_the_plain_step(eager):
    """A 1,000-token prompt and a 10-token one decoding together split into two groups (63 and
    1 blocks of 16): with eager_decode every such tick is the plain step's 2-row time."""
    f = replace(fit(_samples()), eager_decode=eager)
    topo = replace(load_topology("dgx-h200"), calibration=Calibration(device="cpu", steps={"m": {"TP1": f.to_dict()}}))
    reqs = [BenchRequest(list(range(1, 1001)), 40), BenchRequest(list(range(1, 11)), 40)]
    d = Deployment(layout="TP1", max_num_batched_tokens=2048)
    out = simulate(MODEL, topo, d, reqs, rate=float("inf"), model_name="m")
    # without it, the compiled step's time (the fit's keys: about 1,050 positions in all, mid-run)
    want = (plain(2, 0) if eager else f.seconds(2, 0, 1050.0, 0.0, 2 * 1024.0)) * 1e3
    assert plain(2, 0) > 1.2 * f.seconds(2, 0, 1050.0, 0.0, 2 * 1024.0)  # the two differ
    assert out["serve"]["tpot_ms"]["p50"] == pytest.approx(want, rel=0.03)
    # fast-forwarded steady decode times the same ticks as ticking one by one
    p = prepare(MODEL, topo, d, reqs, model_name="m")
    slow, fast = p.run(reqs, rate=float("inf"), fast=False), p.run(reqs, rate=float("inf"), fast=True)
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms", "duration_s"):
        assert fast["serve"][key] == slow["serve"][key], key


def test_a_bucketed_step_is_fitted_at_its_buckets():
    """Decode ticks timed at their row bucket (as the compiled step pads them): the fit reads
    rows(r) at the bucket, so 17 rows cost what 32 do; a step linear in its rows keeps "rows"."""
    def bucketed(r):
        return 1e-3 * (20 + 2 * row_bucket(r))

    shapes = [(r, 0, 500.0, 0.0) for r in (1, 2, 3, 4, 5, 7, 8, 11, 16, 17, 24, 32)]
    chunks = [(r, c, 100.0 * r, 10.0 * c, plain(r, c)) for r in (1, 4, 16) for c in (64, 512)]
    f = fit([(*s, bucketed(s[0])) for s in shapes] + chunks)
    assert f.decode_rows == "bucket"
    assert f.seconds(17, 0, 500.0, 0.0) == pytest.approx(bucketed(32), rel=1e-3)
    assert StepFit.from_dict(f.to_dict(), "x").seconds(9, 0, 500.0, 0.0) == pytest.approx(bucketed(16), rel=1e-3)
    linear = fit([(*s, 1e-3 * (20 + 2 * s[0])) for s in shapes] + chunks)
    assert linear.decode_rows == "rows" and linear.seconds(17, 0, 500.0, 0.0) == pytest.approx(0.054, rel=1e-3)
