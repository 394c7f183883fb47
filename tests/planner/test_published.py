"""The planner against published measurements (tests/data/published.yaml, sources named there):
each sourced prediction must fall within this test's own tolerance, fixed here and never read
from the planner, so widening the planner's stated band cannot turn a miss green. Entries the
planner misses today are strict xfails with the measured ratio in the reason, so a fix that
brings one inside the tolerance fails here until its known_miss is removed from the data file.
Unsourced figures are printed by the example only, never counted here."""

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
UNSOURCED = published.load_entries(section="unsourced")

# issue 35: predicted/measured within 1.25x either way, for every metric
TOLERANCE = 0.25
SHARE_REQUIRED = 0.90  # of the sourced entries within the tolerance (issue 35)


def accepted() -> tuple[float, float]:
    return 1 / (1 + TOLERANCE), 1 + TOLERANCE


# predicted/measured when each known miss was recorded (examples/planner_vs_published.py)
RECORDED_RATIO = {
    "deepseek-profile-h800-prefill-ep32-isl4k": 0.78,
    "tt-dsr1-16xh100-tp16-c1-isl128": 0.62,
    "tt-dsr1-16xh100-tp16-c1-isl4k": 0.61,
    "trtllm-dsr1-h200-dep8-c1024-gpu": 1.29,
    "trtllm-dsr1-h200-dep8-c1024-user": 1.27,
    "trtllm-llama70b-h100-tp4-qps2-ttft": 0.69,
    "trtllm-llama8b-h100-tp1-qps2-ttft": 0.62,
    "vllm-llama405b-2xh100-eth-tp8pp2-vs-tp16": 3.09,
    "distserve-13b-a100-2p1d": 0.59,
    "trtllm-llama70b-h100-tp4-qps8-itl": 0.76,
    "trtllm-llama70b-h100-tp4-467-16-qps2-ttft": 0.77,
}


def _param(e):
    if not e.get("known_miss"):
        return pytest.param(e, id=e["id"])
    reason = (f"known miss: {e['metric']} measured {e['measured']:g}; planner predicted/measured "
              f"{RECORDED_RATIO[e['id']]:.2f} when recorded: {e['known_miss']}")
    return pytest.param(e, id=e["id"], marks=pytest.mark.xfail(strict=True, reason=reason))


def test_data_file_is_complete():
    ids = [e["id"] for e in ENTRIES + UNSOURCED]
    assert len(ids) == len(set(ids))
    for e in ENTRIES + UNSOURCED:
        for key in ("model", "topology", "nodes", "layouts", "precision", "isl", "osl", "metric", "measured",
                    "source", "assumed"):
            assert key in e, (e["id"], key)
        assert e["measured"] > 0 and e["metric"] in published.METRICS
    for e in ENTRIES:
        assert bool(e.get("known_miss")) == (e["id"] in RECORDED_RATIO), e["id"]
        assert "none to cite" not in e["source"], e["id"]
    assert not any(e.get("known_miss") for e in UNSOURCED)


def test_fixture_covers_issue_35():
    """Multi-node wide-EP prefill and decode, TP16 over two nodes, a batch-1 TP8, an xPyD result."""
    metrics = {e["metric"] for e in ENTRIES}
    assert {"prefill_tokens_per_s_per_gpu", "decode_tokens_per_s_per_gpu", "disagg_gain"} <= metrics
    assert any(e["layouts"][0] == "TP16" and e["nodes"] == 2 and e.get("concurrency") == 1 for e in ENTRIES)
    assert any(e["layouts"][0].startswith("TP8") and e["nodes"] == 1 and e.get("concurrency") == 1 for e in ENTRIES)


def test_tolerance_bounds():
    assert accepted() == pytest.approx((0.8, 1.25))


@pytest.mark.parametrize("entry", [_param(e) for e in ENTRIES])
def test_prediction_within_tolerance(entry):
    c = published.compare(entry)
    lo, hi = accepted()
    assert lo <= c.ratio <= hi, (f"{entry['id']}: predicted {c.predicted:.3g} vs measured {entry['measured']:g}, "
                                 f"ratio {c.ratio:.2f} outside {lo:.2f}-{hi:.2f}")


@pytest.mark.xfail(strict=True, reason="issue 35 asks for 90% of sourced entries within 1.25x; 15 of 26 (58%) "
                   "when recorded: the known misses above")
def test_share_within_tolerance():
    lo, hi = accepted()
    inside = sum(lo <= published.compare(e).ratio <= hi for e in ENTRIES)
    assert inside / len(ENTRIES) >= SHARE_REQUIRED, f"{inside} of {len(ENTRIES)} within 1.25x"


def test_unsourced_entries_still_compute():
    for e in UNSOURCED:
        assert published.compare(e).predicted > 0, e["id"]
