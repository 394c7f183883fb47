"""`atoll calibrate` and `atoll plan --check`: the measured topology reads back and feeds the
cost model; the check runs a layout and reports predicted against measured."""

import json

import pytest
import yaml
from cli import run_cli as run

from atoll.launch.cli import main
from atoll.topologies import load_topology

OPS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "send_recv")




@pytest.fixture(scope="module")
def calibrated(tmp_path_factory):
    out = tmp_path_factory.mktemp("cal") / "calibrated.yaml"
    with pytest.raises(SystemExit) as e:
        main(["calibrate", "--quick", "--no-progress", "--max-ranks", "2", "--out", str(out)])
    assert e.value.code == 0
    return out


def test_calibrate_writes_a_topology_that_reads_back(calibrated):
    topo = load_topology(str(calibrated))
    cal = topo.calibration
    assert topo.gpu.name == "cpu-core" and cal is not None and cal.device == "cpu"
    assert set(cal.gemm_tflops) == {"fp32", "bf16"} and all(v > 0 for v in cal.gemm_tflops["fp32"].values())
    # a decode GEMM (1 row) streams its weights: far below the rate at prefill sizes
    assert cal.gemm_tflops["fp32"][1] < cal.gemm_tflops["fp32"][256]
    assert {1, 2} <= set(cal.memory_gb_s)
    assert set(cal.overhead_us) == {"step", "per_seq", "dense_layer", "moe_layer"}
    assert set(cal.collectives) == set(OPS) and all(2 in cal.collectives[op] for op in OPS)
    lat, bw = cal.collectives["all_reduce"][2]
    assert 0 <= lat < 0.1 and bw > 1e6
    text = calibrated.read_text()
    assert "atoll calibrate --quick" in text and "load average" in text  # how it was measured


def test_calibration_enters_the_cost_model(calibrated, tmp_path):
    from atoll.calibrate.tiny import write_tiny
    from atoll.models.config import ModelConfig
    from atoll.planner import Workload, plan_layouts

    d = json.loads(json.dumps(yaml.safe_load(calibrated.read_text())))
    config = ModelConfig.load(write_tiny(tmp_path / "m", layers=4))
    w = Workload(isl=16, osl=8, concurrency=4)

    def tpot(data):
        f = tmp_path / "t.yaml"
        f.write_text(yaml.safe_dump(data))
        return plan_layouts(config, load_topology(str(f)), w, layouts=["1 x TP1"]).predictions[0].tpot_s

    base = tpot(d)
    d["calibration"]["overhead_us"]["dense_layer"] += 1000  # 1 ms more per layer: 4 ms more per step
    assert tpot(d) - base == pytest.approx(4e-3, rel=1e-6)


@pytest.mark.parametrize("bad, error", [
    ({"collectives": {"all_reduce": {2: {"latency_us": -1, "gb_s": 1}}}}, "latency_us=-1 must be a non-negative"),
    ({"memory_gb_s": {1: float("nan")}}, "memory_gb_s.1=nan must be a positive number"),
    ({"overhead_us": {"per_token": 3}}, "overhead_us: fields are"),
    ({"gemm_tflops": {"fp32": {"one": 1.0}}}, "key 'one' must be a whole number"),
])
def test_bad_calibration_is_one_line(calibrated, tmp_path, capsys, bad, error):
    d = yaml.safe_load(calibrated.read_text())
    d["calibration"] |= bad
    f = tmp_path / "bad.yaml"
    f.write_text(yaml.safe_dump(d))
    code, _, err = run(capsys, "plan", "--model", "Llama-3.1-8B", "--topology", f)
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and error in lines[0], err


def test_check_runs_a_layout_and_reports_the_error(calibrated, tmp_path, capsys):
    from atoll.calibrate.tiny import write_tiny

    model = write_tiny(tmp_path / "tiny", layers=2)
    code, out, _ = run(capsys, "plan", "--check", "--model", model, "--topology", calibrated, "--layouts", "TP1,TP2",
                       "--isl", "8", "--osl", "4", "--concurrency", "2", "--rounds", "1", "--warmup", "0",
                       "--format", "json")
    r = json.loads(out)
    assert code == 0 and [row["layout"] for row in r["rows"]] == ["TP1", "TP2"]
    for row in r["rows"]:
        assert row["measured_tpot_s"] > 0 and row["predicted_tpot_s"] > 0
        assert row["tpot_error"] == pytest.approx(row["predicted_tpot_s"] / row["measured_tpot_s"] - 1)
    assert r["median_abs_tpot_error"] >= 0 and len(r["load_avg_1m"]) == 3


def test_check_needs_a_checkpoint(capsys):
    code, _, err = run(capsys, "plan", "--check", "--model", "DeepSeek-V3", "--topology", "local")
    assert code == 2 and "must be a checkpoint directory" in err
