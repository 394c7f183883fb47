"""atoll bench dispatch: output formats, byte accounting against the minimum, bad input."""

import json
import re

import cli
import pytest


SMALL = ["--tokens", "48", "--hidden", "16", "--experts", "6", "--topk", "3", "--iters", "3", "--warmup", "1"]


def run_cli(capsys, *argv):
    return cli.run_cli(capsys, "bench", *argv)


@pytest.mark.timeout(120)
def test_table_prints_the_ratio_line(capsys):
    code, out, err = run_cli(capsys, "dispatch", *SMALL, "--ep", "2")
    assert code == 0, err
    assert re.search(r"^dispatch/all-to-all ratio: \d+\.\d\d$", out, re.M), out
    assert "expert load imbalance" in out and "minimum" in out


@pytest.mark.timeout(120)
def test_json_hierarchical_reaches_the_cross_island_minimum(capsys):
    code, out, err = run_cli(capsys, "dispatch", *SMALL, "--ep", "4", "--hierarchical", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["config"]["islands"] == [[0, 1], [2, 3]]
    assert r["ratio"] > 0 and r["dispatch_combine_ms"] > 0 and r["all_to_all_ms"] > 0
    cross, intra = r["bytes"]["cross"], r["bytes"]["intra"]
    # island first: hidden rows cross exactly once per (token, remote island), each way
    assert cross["rows"] == cross["min"] > 0
    assert cross["sent"] > cross["rows"]  # plus the packed ids and weights
    assert intra["rows"] >= intra["min"]
    # 3 of 6 experts: tokens often pick two on the remote island, so flat sends more across
    assert r["cross_rows"]["hierarchical"] == cross["rows"] < r["cross_rows"]["flat"]
    assert 0 < r["cross_rows"]["saving"] < 1
    assert r["load_imbalance"] >= 1.0


@pytest.mark.parametrize("argv,line", [
    (["dispatch", "--topk", "5", "--experts", "4"], "--topk 5 is larger than --experts 4"),
    (["dispatch", "--ep", "1"], "--ep 1: the bench needs at least 2 ranks"),
    (["dispatch", "--ep", "4", "--islands", "5"], "--islands 5 must be between 1 and --ep 4"),
    (["dispatch", "--hierarchical", "--islands", "1"], "--hierarchical needs --islands 2 or more"),
    (["dispatch", "--capacity-factor", "0"], "--capacity-factor 0.0 must be positive"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, line):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.startswith("atoll: error: ")
    assert line in err and len(err.strip().splitlines()) == 1, err
