"""The planner against published measurements (tests/data/published.yaml, sources named there):
each prediction must fall inside this test's own tolerance, fixed here and never read from the
planner, so widening the planner's stated band cannot turn a miss green. Entries the planner
misses today are strict xfails with the measured ratio in the reason, so a fix that brings one
inside the tolerance fails here until its known_miss is removed from the data file."""

import importlib.util
import sys

import pytest

from paths import REPO

_SCRIPT = REPO / "examples" / "planner_vs_published.py"
_spec = importlib.util.spec_from_file_location("planner_vs_published", _SCRIPT)
published = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = published  # dataclasses look their module up there
_spec.loader.exec_module(published)

ENTRIES = published.load_entries()

# predicted/measured must be within 1 +- TOLERANCE of the metric (issue 14's comparison: +-25% on
# TPOT and tokens/s, +-50% on TTFT). A ratio of two layouts' tokens/s, each within +-t, lies in
# (1 - t)/(1 + t) .. (1 + t)/(1 - t).
TOLERANCE = {"tokens_per_s_per_user": 0.25, "tokens_per_s_per_gpu": 0.25, "tpot_ms": 0.25, "ratio": 0.25,
             "ttft_ms": 0.50}


def accepted(metric: str) -> tuple[float, float]:
    t = TOLERANCE[metric]
    return ((1 - t) / (1 + t), (1 + t) / (1 - t)) if metric == "ratio" else (1 - t, 1 + t)

# predicted/measured when each known miss was recorded (examples/planner_vs_published.py)
RECORDED_RATIO = {
    "dsv3-h200-tp8-c1": 2.56,
    "dsr1-2xh100-c1": 0.61,
    "dsr1-2xh100-c25-itl": 0.62,
    "dsr1-2xh100-c25-ttft": 0.17,
    "llama405b-2xh100-eth-tp8pp2-vs-tp16": 2.43,
}


def _param(e):
    if not e.get("known_miss"):
        return pytest.param(e, id=e["id"])
    reason = (f"known miss: {e['metric']} measured {e['measured']:g} ({e['source']}); planner "
              f"predicted/measured {RECORDED_RATIO[e['id']]:.2f} when recorded: {e['known_miss']}")
    return pytest.param(e, id=e["id"], marks=pytest.mark.xfail(strict=True, reason=reason))


def test_data_file_is_complete():
    ids = [e["id"] for e in ENTRIES]
    assert len(ids) == len(set(ids))
    for e in ENTRIES:
        for key in ("model", "topology", "nodes", "layouts", "precision", "isl", "osl", "concurrency",
                    "metric", "measured", "source"):
            assert key in e, (e["id"], key)
        assert e["measured"] > 0 and e["metric"] in TOLERANCE
        assert bool(e.get("known_miss")) == (e["id"] in RECORDED_RATIO), e["id"]


def test_tolerance_bounds():
    assert accepted("tpot_ms") == (0.75, 1.25) and accepted("ttft_ms") == (0.5, 1.5)
    assert accepted("ratio") == pytest.approx((0.6, 1 / 0.6))


@pytest.mark.parametrize("entry", [_param(e) for e in ENTRIES])
def test_prediction_within_tolerance(entry):
    c = published.compare(entry)
    lo, hi = accepted(entry["metric"])
    assert lo <= c.ratio <= hi, (f"{entry['id']}: predicted {c.predicted:.3g} vs measured {entry['measured']:g}, "
                                 f"ratio {c.ratio:.2f} outside {lo:.2f}-{hi:.2f}")

