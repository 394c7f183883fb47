"""atoll bench dispatch: output formats, byte accounting per path and link class against the
minimum, the simulated slow link between islands, bad input."""

import json
import re

import cli
import pytest


SMALL = ["--tokens", "48", "--hidden", "16", "--experts", "6", "--topk", "3", "--iters", "2", "--warmup", "1"]
SLOW = ["--cross-gb-s", "2", "--cross-latency-us", "10"]


def run_cli(capsys, *argv):
    return cli.run_cli(capsys, "bench", *argv)


@pytest.mark.timeout(120)
def test_table_prints_the_ratio_line(capsys):
    code, out, err = run_cli(capsys, "dispatch", *SMALL, "--ep", "2")
    assert code == 0, err
    assert re.search(r"^dispatch/all-to-all ratio: \d+\.\d\d$", out, re.M), out
    assert re.search(r"^bytes sent, all ranks, flat: intra \d+ \(rows \d+\), cross 0 \(rows 0\)$", out, re.M), out
    assert "expert load imbalance" in out and "SIMULATED" not in out


@pytest.mark.timeout(120)
def test_json_hierarchical_reaches_the_cross_island_minimum_and_sleeps_only_across(capsys):
    code, out, err = run_cli(capsys, "dispatch", *SMALL, "--ep", "4", "--hierarchical", *SLOW, "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["config"]["islands"] == [[0, 1], [2, 3]] and r["two_level"] is True
    assert r["ratio"] > 0 and r["dispatch_combine_ms"] > 0 and r["all_to_all_ms"] > 0
    assert r["flat_ms"] > 0 and r["hierarchical_over_flat"] > 0
    flat, hier, least = r["bytes"]["flat"], r["bytes"]["hierarchical"], r["min_row_bytes"]
    # island first: hidden rows cross exactly once per (token, remote island), each way
    assert hier["cross"]["rows"] == least["cross"] > 0
    assert hier["cross"]["sent"] > hier["cross"]["rows"]  # plus the packed ids and weights
    assert hier["intra"]["rows"] >= least["intra"]
    # 3 of 6 experts: tokens often pick two on the remote island, so flat sends more across
    assert flat["cross"]["rows"] > hier["cross"]["rows"] and flat["intra"]["rows"] > 0
    assert 0 < r["cross_saving"] < 1
    assert r["cross_bytes_hierarchical_over_flat"] == round(hier["cross"]["sent"] / flat["cross"]["sent"], 4)
    assert r["load_imbalance"] >= 1.0

    sim = r["simulated_link"]
    assert sim["simulated"] is True and sim["gb_s"] == 2 and sim["latency_us"] == 10
    delay = sim["delay_ms_per_iter"]
    # two-level: only the rails cross; flat: the whole ep group; the bare side copies the two-level legs
    assert delay["hierarchical"]["ep_rail"] > 0 and delay["hierarchical"]["ep_island"] == 0
    assert delay["hierarchical"]["ep"] == 0
    assert delay["flat"]["ep"] > 0 and delay["flat"]["ep_island"] == delay["flat"]["ep_rail"] == 0
    assert delay["bare"]["ep_rail"] > 0 and delay["bare"]["ep_island"] == delay["bare"]["ep"] == 0
    # flat: counts, rows out, rows back over the ep group, each at least the latency (0.01 ms)
    assert delay["flat"]["ep"] >= 3 * 0.01
    assert 0 < sim["delay_hierarchical_over_flat"] < 1


@pytest.mark.timeout(120)
def test_unequal_islands_fall_back_to_the_ep_group(capsys):
    code, out, err = run_cli(capsys, "dispatch", *SMALL, "--ep", "3", "--hierarchical", *SLOW, "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["config"]["islands"] == [[0, 1], [2]] and r["two_level"] is False
    assert r["bytes"]["hierarchical"]["cross"]["rows"] == r["min_row_bytes"]["cross"] > 0
    delay = r["simulated_link"]["delay_ms_per_iter"]["hierarchical"]
    assert delay["ep"] > 0 and delay["ep_island"] == delay["ep_rail"] == 0


@pytest.mark.timeout(120)
def test_table_names_the_simulation(capsys):
    code, out, err = run_cli(capsys, "dispatch", *SMALL, "--ep", "4", "--hierarchical", *SLOW)
    assert code == 0, err
    assert re.search(r"^SIMULATED slow link between islands: 2.0 GB/s \+ 10 us, a sleep", out, re.M), out
    assert re.search(r"^bytes sent, all ranks, hierarchical: intra \d+ \(rows \d+\), cross \d+ \(rows (\d+)\); "
                     r"cross rows minimum (\d+)$", out, re.M), out
    m = re.search(r"^hierarchical/flat time ratio: \d+\.\d\d \(cross bytes ratio 0\.\d\d; "
                  r"simulated slow link, simulated delay ratio 0\.\d\d\)$",
                  out, re.M)
    assert m, out


SWEEP = ["--hidden", "16", "--experts", "6", "--topk", "3", "--iters", "2", "--warmup", "1"]


@pytest.mark.timeout(120)
def test_exchange_sweep_json_counts_gather_bytes_and_sleeps_it_across_islands(capsys):
    code, out, err = run_cli(capsys, "dispatch", "--exchange-sweep", "1,3", *SWEEP, "--ep", "4", "--islands", "2",
                             "--cross-latency-us", "10", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert [row["rows"] for row in r["sweep"]] == [1, 3] and r["simulated_link"]["simulated"] is True
    for row in r["sweep"]:
        n = row["rows"]
        assert set(row["ms"]) == {"all_to_all", "gather"} and min(row["ms"].values()) > 0
        # gather_combine, 4 ranks with 2 peers across: n packed rows (16 fp32 + 3 ids + 3 weights) out
        # and n rows of partial sums back, to each
        assert row["bytes"]["gather"] == {"intra": 4 * 1 * n * (64 + 24 + 64), "cross": 4 * 2 * n * (64 + 24 + 64)}
        assert row["bytes"]["all_to_all"]["cross"] > 0
        delay = row["delay_ms_per_iter"]
        assert delay["gather"]["ep"] >= 2 * 0.01 and delay["gather"]["ep_island"] == delay["gather"]["ep_rail"] == 0
        assert row["gather_over_all_to_all"] == round(row["ms"]["gather"] / row["ms"]["all_to_all"], 4)
    switch = r["switch_to_all_to_all_at_rows"]
    wins = [row["rows"] for row in r["sweep"] if row["gather_over_all_to_all"] > 1]
    assert switch == (3 if wins == [3] else 1 if wins == [1, 3] else None)


@pytest.mark.timeout(120)
def test_exchange_sweep_table_names_the_switch(capsys):
    code, out, err = run_cli(capsys, "dispatch", "--exchange-sweep", "1,2", *SWEEP, "--ep", "2")
    assert code == 0, err
    assert re.search(r"^rows 2: gather/all-to-all \d+\.\d\d; bytes intra, cross: all_to_all \d+, 0; gather \d+, 0$",
                     out, re.M), out
    assert re.search(r"^(switch to all_to_all at 2 rows per rank|gather_combine faster up to 2 rows per rank|"
                     r"all_to_all faster at every count tried \(1 to 2 rows per rank\))", out, re.M), out


@pytest.mark.parametrize("argv,line", [
    (["dispatch", "--topk", "5", "--experts", "4"], "--topk 5 is larger than --experts 4"),
    (["dispatch", "--ep", "1"], "--ep 1: the bench needs at least 2 ranks"),
    (["dispatch", "--ep", "4", "--islands", "5"], "--islands 5 must be between 1 and --ep 4"),
    (["dispatch", "--hierarchical", "--islands", "1"], "--hierarchical needs --islands 2 or more"),
    (["dispatch", "--capacity-factor", "0"], "--capacity-factor 0.0 must be positive"),
    (["dispatch", "--hierarchical", "--cross-gb-s", "0"], "--cross-gb-s 0.0 must be a positive number of GB/s"),
    (["dispatch", "--hierarchical", "--cross-latency-us", "-1"], "--cross-latency-us -1.0 must be 0 or more"),
    (["dispatch", "--cross-gb-s", "10"], "--cross-gb-s and --cross-latency-us need --islands 2 or more"),
    (["dispatch", "--warmup", "-1"], "--warmup -1 must be 0 or more"),
    (["dispatch", "--exchange-sweep", "1,x"], "--exchange-sweep '1,x' must be comma-separated row counts"),
    (["dispatch", "--exchange-sweep", "0,4"], "--exchange-sweep 0,4: every row count must be at least 1"),
    (["dispatch", "--exchange-sweep", "--capacity-factor", "1"], "--capacity-factor does not apply"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, line):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert err.startswith("atoll: error: ")
    assert line in err and len(err.strip().splitlines()) == 1, err
