"""examples/shifting_load.py's workload and its split into halves (the servers it starts are
atoll serve's, tested under tests/serve)."""

import importlib.util
import sys

import pytest

from atoll.planner.sim.report import RequestResult
from paths import REPO

_spec = importlib.util.spec_from_file_location("shifting_load", REPO / "examples" / "shifting_load.py")
shifting = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = shifting
_spec.loader.exec_module(shifting)


def test_the_first_half_is_short_and_the_second_a_mix():
    args = shifting.argparse.Namespace(rate=2.0, half_s=10.0, input_len=8, range_ratio=0.0, long_len=100,
                                       long_share=0.5, output_len=4, seed=0)
    requests, first = shifting.build(args, vocab=50)
    assert first == 20 and len(requests) == 40
    assert all(r.prompt_len == 8 for r in requests[:first])
    lengths = {r.prompt_len for r in requests[first:]}
    assert lengths == {8, 100}
    assert 4 <= sum(r.prompt_len == 100 for r in requests[first:]) <= 16


def test_halves_cut_at_the_first_mixed_send():
    results = [RequestResult(success=True, output_tokens=3, ttft=0.1 * (i + 1), latency=1.0, start=float(i))
               for i in range(6)]
    first, second = shifting.halves(results, 3, 8.0, {"ttft": 250})
    assert (first["requests"], second["requests"]) == (3, 3)
    assert first["duration_s"] == 3.0 and second["duration_s"] == 5.0
    assert first["goodput"]["good_requests"] == 2 and second["goodput"]["good_requests"] == 0
    assert first["goodput"]["request_goodput"] == pytest.approx(2 / 3)


def test_a_side_is_name_equals_flags():
    assert shifting.parse_side("4 replicas=-dp 4 --max-num-seqs 8") == ("4 replicas", ["-dp", "4", "--max-num-seqs", "8"])
    with pytest.raises(SystemExit, match="NAME=FLAGS"):
        shifting.parse_side("-dp 4")
