"""atoll bench (the model bench): a smoke run on a tiny random model, JSON fields consistent."""

import json

import cli
import pytest
import torch


def run_cli(capsys, *argv):
    return cli.run_cli(capsys, "bench", *argv)


@pytest.mark.timeout(120)
def test_json_smoke_on_a_tiny_model(capsys, tiny_model):
    model = tiny_model("llama")
    code, out, err = run_cli(capsys, "--model", str(model), "--device", "cpu", "--dtype", "float32", "--batch", "2",
                             "--input-len", "8", "--output-len", "4", "--rounds", "2", "--json")
    assert code == 0, err
    r = json.loads(out)
    a, h = r["atoll"], r["transformers"]
    assert a["output_tokens"] == h["output_tokens"] == 2 * 4
    for side in (a, h):
        assert side["total_s"] > 0 and side["prefill_s"] > 0 and side["decode_step_s"] > 0
        assert side["tokens_per_s"] == pytest.approx(side["output_tokens"] / side["total_s"], rel=1e-3)
    lo, hi = r["vs_transformers_range"]  # the per-round ratios' range: with 2 rounds, their median is the mean
    assert 0 < lo <= hi and r["vs_transformers"] == pytest.approx((lo + hi) / 2, rel=1e-3)
    assert r["load_avg_rounds"] and len(r["load_avg_rounds"]) == 2  # read after each timed round
    assert r["decode_weight_bytes"] > 0 and r["copy_bandwidth_gb_s"] > 0 and r["floor_step_s"] > 0
    assert r["of_bandwidth_floor"] == pytest.approx(r["floor_step_s"] / a["decode_step_s"], rel=1e-2)
    c = r["config"]
    assert (c["batch"], c["input_len"], c["output_len"], c["layout"]) == (2, 8, 4, "TP1")
    assert c["threads"]["transformers"] == c["threads"]["atoll_per_rank"] * c["threads"]["ranks"]
    assert c["dtype"] == "float32" and c["device"] == "cpu" and c["device_name"] == "cpu"
    assert r["same_greedy_sequences"] == 2  # same model, same dtype, same device: same greedy tokens


@pytest.mark.timeout(120)
def test_table_names_the_device_and_dtype_and_prints_both_figures(capsys, tiny_model):
    code, out, err = run_cli(capsys, "model", "--model", str(tiny_model("llama")), "--device", "cpu",
                             "--dtype", "bfloat16", "--batch", "1", "--input-len", "4", "--output-len", "2",
                             "--rounds", "1", "--warmup", "0")
    assert code == 0, err
    assert "TP1 bfloat16 on cpu: batch 1" in " ".join(out.split())  # the title may wrap
    assert "vs transformers: " in out and "of bandwidth floor: " in out
    lines = out.strip().splitlines()
    assert lines[-2].startswith("vs transformers: ") and lines[-2].endswith("x")
    assert lines[-1].startswith("of bandwidth floor: ")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_device_cuda_without_a_gpu_is_one_line_exit_2(capsys, tiny_model):
    model = tiny_model("llama")
    capsys.readouterr()  # the fixture's own output
    code, out, err = run_cli(capsys, "--model", str(model), "--device", "cuda", "--batch", "1",
                             "--input-len", "4", "--output-len", "2")
    assert code == 2
    lines = err.strip().splitlines()
    assert len(lines) == 1 and "--device cuda" in lines[0] and "no GPU" in lines[0], err


@pytest.mark.timeout(200)
def test_pp_measures_the_bubble_against_one_micro_batch_at_a_time(capsys, tiny_model):
    code, out, err = run_cli(capsys, "--model", str(tiny_model("llama", num_hidden_layers=4)), "--layout", "PP2",
                             "--batch", "8", "--input-len", "4", "--output-len", "6", "--rounds", "1",
                             "--warmup", "0", "--json")
    assert code == 0, err
    p = json.loads(out)["pipeline"]
    assert p["same_tokens"] is True
    assert len(p["stage_busy"]) == len(p["one_at_a_time_stage_busy"]) == 2
    assert all(0 < b <= 1 for b in p["stage_busy"] + p["one_at_a_time_stage_busy"])
    assert p["bubble"] == pytest.approx(1 - sum(p["stage_busy"]) / 2, abs=2e-3)
    # one micro-batch at a time leaves each of the two stages idle about half the run
    assert p["one_at_a_time_bubble"] > 0.3
    assert p["vs_one_at_a_time"] == pytest.approx(p["tokens_per_s"] / p["one_at_a_time_tokens_per_s"], rel=1e-3)


@pytest.mark.parametrize("argv,line", [
    (["--output-len", "1"], "--output-len 1: a decode step needs at least 2 output tokens"),
    (["--batch", "0"], "--batch 0 must be positive"),
])
def test_bad_input_is_one_line_exit_2(capsys, argv, line):
    code, out, err = run_cli(capsys, *argv)
    assert code == 2
    assert line in err and len(err.strip().splitlines()) == 1, err
