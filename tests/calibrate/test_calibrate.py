"""`atoll calibrate` and `atoll plan --check`: the measured topology reads back and feeds the
cost model; the check runs a layout and reports predicted against measured."""

import json
import time

import pytest
import yaml
from cli import run_cli as run

from atoll.cli.main import main
from atoll.topologies import load_topology
import atoll.cli.calibrate as cli_calibrate

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
    assert set(cal.overhead_us) == {"step", "per_seq", "dense_layer", "moe_layer", "seq_layer"}
    assert set(cal.collectives) == set(OPS) and all(2 in cal.collectives[op] for op in OPS)
    lat, bw = cal.collectives["all_reduce"][2]
    assert 0 <= lat < 0.1 and 1e6 < bw < 1e12  # seconds (the fit clamps at 0) and bytes/s
    text = calibrated.read_text()
    written = yaml.safe_load(text)["calibration"]["collectives"]["all_reduce"][2]  # as measured, in the file
    assert (lat, bw) == pytest.approx((written["latency_us"] * 1e-6, written["gb_s"] * 1e9), rel=1e-12, abs=1e-15)
    assert "atoll calibrate --quick" in text and "load average" in text  # how it was measured
    assert "gloo" in cal.how and "fp8" not in cal.gemm_tflops and 0 < cal.share(2) <= 1.0
    # the KV cache tiers' bandwidths, measured through the engine's own tiers, read back
    tiers = topo.kv_tiers
    assert all(v > 0 for v in (tiers.host.read_gb_s, tiers.host.write_gb_s, tiers.disk.read_gb_s,
                               tiers.disk.write_gb_s))
    assert yaml.safe_load(text)["kv_tiers"] == tiers.to_dict() and "KV tiers" in cal.how


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

    # the per-sequence terms off: they follow the decode batch, which moves when the step slows
    # (by up to 0.15% of the 4 ms below with this machine's measured seq_layer)
    d["calibration"]["overhead_us"] |= {"per_seq": 0.0, "seq_layer": 0.0}
    base = tpot(d)
    d["calibration"]["overhead_us"]["dense_layer"] += 1000  # 1 ms more per layer: 4 ms more per step
    # to the tolerance of steady serving's fixed point (planner/serving.py)
    assert tpot(d) - base == pytest.approx(4e-3, rel=1e-3)


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
    # the median of two rows is their mean: the summary is the rows' own errors, not a figure of its own
    errors = [abs(row["predicted_tpot_s"] / row["measured_tpot_s"] - 1) for row in r["rows"]]
    assert r["median_abs_tpot_error"] == pytest.approx(sum(errors) / 2)
    assert len(r["load_avg_1m"]) == 3


def test_check_needs_a_checkpoint(capsys):
    code, _, err = run(capsys, "plan", "--check", "--model", "DeepSeek-V3", "--topology", "local")
    assert code == 2 and "must be a checkpoint directory" in err


# -- the GPU side, without a GPU: device-generic timing on the CPU, the topology from a table --

def test_device_generic_timing_runs_on_the_cpu():
    import torch

    from atoll.calibrate import compute, timing
    from atoll.calibrate.gpu import fp8_gemm_tflops

    calls = []
    # a 2 ms call in a 10 ms budget: a warm-up, one call to size the repeats, then 3 to 5 repeats
    mean = timing.timed(lambda: (calls.append(1), time.sleep(0.002)), 0.01, least=3, device="cpu")
    assert 0.002 <= mean < 0.1 and 5 <= len(calls) <= 7, (mean, len(calls))  # seconds, on a loaded machine too
    timing.sync("cpu")
    assert compute.shape_for("cuda:0") == (compute.GPU_K, compute.GPU_N) and compute.shape_for("cpu") == (1024, 1024)
    small = dict(device="cpu", shape=(64, 32), stream_bytes=2**16)
    table = compute.gemm_tflops(torch.bfloat16, 0.001, rows=(1, 16), **small)
    assert set(table) == {1, 16} and all(1e-7 < v < 100 for v in table.values())  # TFLOP/s of one CPU
    assert 1e-3 < compute.read_gb_s(0.001, device="cpu", nbytes=2**20) < 1e4  # GB/s, even on a loaded core
    assert 1e-3 < compute.copy_gb_s(0.001, device="cpu", nbytes=2**20) < 1e4
    fp8, why = fp8_gemm_tflops(0.001, (1, 16), **small)
    # a CPU build of torch may or may not run _scaled_mm: ask it here, then expect that answer's branch
    runs, e4m3 = [], getattr(torch, "float8_e4m3fn", None)
    for m in (1, 16) if hasattr(torch, "_scaled_mm") and e4m3 is not None else ():
        try:  # the same operands: x [m, k=64], w [n=32, k=64] read column-major
            torch._scaled_mm(torch.randn(m, 64).to(e4m3), torch.randn(32, 64).to(e4m3).t(),
                             scale_a=torch.ones(()), scale_b=torch.ones(()), out_dtype=torch.bfloat16)
            runs.append(m)
        except (RuntimeError, TypeError, NotImplementedError):
            pass
    assert sorted(fp8) == runs and all(1e-7 < v < 100 for v in fp8.values()), (fp8, why)
    refused = [str(m) for m in (1, 16) if m not in runs]
    if len(refused) == 2 and not hasattr(torch, "_scaled_mm"):
        assert why == f"torch {torch.__version__} has no torch._scaled_mm"
    elif refused:
        assert why.startswith(f"torch._scaled_mm refused {', '.join(refused)} rows: "), why
    else:
        assert why == "", why


def _gpu_cal(gpus: int, *, fp8: bool = True) -> dict:
    """A measured table as `atoll calibrate` writes it on a GPU node; the figures are made up
    for the test (H200-like orders of magnitude), nothing here was measured."""
    gemm = {"fp32": {1: 1.0, 4096: 55.0}, "bf16": {1: 2.0, 64: 120.0, 4096: 700.0}}
    if fp8:
        gemm["fp8"] = {1: 4.0, 64: 240.0, 4096: 1300.0}
    colls = {op: {n: {"latency_us": 12.0 + n, "gb_s": 300.0} for n in range(2, gpus + 1)} for op in OPS} \
        if gpus > 1 else {}  # as calibrate writes one GPU: no collectives
    return {"device": "cuda", "cores": 16, "how": "made up for a test", "gemm_tflops": gemm,
            "memory_gb_s": {n: 4300.0 for n in range(1, gpus + 1)},
            "overhead_us": {"step": 900.0, "per_seq": 5.0, "dense_layer": 150.0, "moe_layer": 300.0},
            "collectives": colls}


def _written(data: dict, path):
    from atoll.calibrate import write_yaml

    write_yaml(data, path)
    return load_topology(str(path))


def test_gpu_topology_from_a_measured_table_loads_and_plans(tmp_path):
    from atoll.calibrate.gpu import gpu_topology_dict
    from atoll.planner import Workload, plan_layouts

    data = gpu_topology_dict(_gpu_cal(8), host="h", gpu_name="NVIDIA H200", memory_gib=139.8, gpus=8,
                             islands=[list(range(8))])
    topo = _written(data, tmp_path / "gpu.yaml")
    g, cal = topo.gpu, topo.calibration
    assert topo.gpus_per_node == 8 and g.name == "NVIDIA H200" and g.memory_gib == 139.8
    assert (g.bf16_tflops, g.fp8_tflops, g.fp32_tflops, g.hbm_tb_s) == (700.0, 1300.0, 55.0, 4.3)
    assert topo.island_size == 8 and topo.island_link.kind == "nvlink"
    assert (topo.island_link.gb_s, topo.island_link.latency_us) == (300.0, 14.0)  # send_recv over 2 GPUs
    assert cal.device == "cuda" and cal.share(8) == 1.0 and cal.memory_bytes_s(16) == 4300e9  # own HBM each
    w = Workload(isl=512, osl=64, concurrency=8)
    plan = plan_layouts("Llama-3.1-8B", topo, w, layouts=["TP1", "TP2", "TP8"])
    assert all(0 < p.tpot_s < 1 and 0 < p.ttft_s < 10 for p in plan.predictions)

    def tp8(change):
        d = yaml.safe_load((tmp_path / "gpu.yaml").read_text())
        change(d["calibration"])
        return plan_layouts("Llama-3.1-8B", _written(d, tmp_path / "t.yaml"), w, layouts=["TP8"]).predictions[0]

    base = tp8(lambda c: None)
    slower = tp8(lambda c: c["collectives"]["all_reduce"][8].update(latency_us=1000.0))  # NCCL's figures are used
    # 32 layers x 2 all-reduces + the vocab-parallel embedding's one, each 1000 us instead of 12 + 8 us
    assert slower.tpot_s - base.tpot_s == pytest.approx(65 * (1000.0 - 20.0) * 1e-6, rel=1e-3)
    halved = tp8(lambda c: c["gemm_tflops"].update(bf16={m: v / 2 for m, v in c["gemm_tflops"]["bf16"].items()}))
    # the measured GEMM rates are used: prefill's compute takes twice as long, its collectives the same
    assert halved.prefill["compute"] == pytest.approx(2 * base.prefill["compute"], rel=1e-9)
    assert {k: v for k, v in halved.prefill.items() if k != "compute"} == \
        {k: v for k, v in base.prefill.items() if k != "compute"}
    eager = tp8(lambda c: c["overhead_us"].update(dense_layer=1e5))  # the eager overhead is not costed on a GPU
    assert eager.tpot_s == base.tpot_s


def test_one_gpu_has_no_collectives_and_plans_on_sourced_links(tmp_path):
    from atoll.calibrate.gpu import gpu_topology_dict
    from atoll.planner import Workload, plan_layouts

    cal = _gpu_cal(1, fp8=False)
    assert cal["collectives"] == {}
    data = gpu_topology_dict(cal, host="h", gpu_name="Some Future GPU", memory_gib=80.0, gpus=1)
    topo = _written(data, tmp_path / "one.yaml")
    assert topo.gpus_per_node == 1 and topo.gpu.fp8_tflops == 0 and topo.calibration.collectives == {}
    assert "not measured" in topo.notes and topo.node_link.gb_s == 32.0  # discovery's default, said so
    plan = plan_layouts("Llama-3.1-8B", topo, Workload(isl=256, osl=32, concurrency=4, dtype="fp8"), layouts=["TP1"])
    assert 0 < plan.predictions[0].tpot_s < 1
    h200 = _written(gpu_topology_dict(cal, host="h", gpu_name="NVIDIA H200", memory_gib=139.8, gpus=1),
                    tmp_path / "h200.yaml")
    assert h200.node_link.gb_s == load_topology("dgx-h200").node_link.gb_s  # the preset's sourced figure


def test_calibrate_device_cuda_without_a_gpu_is_one_line(tmp_path, capsys):
    code, _, err = run(capsys, "calibrate", "--device", "cuda", "--no-progress", "--out", tmp_path / "c.yaml")
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and "no GPU" in lines[0], err


def test_steps_take_several_models_each_at_the_layouts_it_admits(tiny_model, monkeypatch, capsys):
    """--steps repeated, MODEL_DIR:LAYOUTS giving one model its own; a layout a model's heads do
    not admit is skipped with a line, a layout that does not parse fails before any server starts."""
    import argparse

    from atoll.errors import LayoutError

    runs = []
    monkeypatch.setattr(cli_calibrate, "measure_steps",
                        lambda model, layouts, **kw: runs.append(layouts) or {t: {} for t in layouts})
    llama = tiny_model("llama")  # 4 heads, 2 KV heads: no TP3
    args = argparse.Namespace(steps=[str(llama), f"{llama}:TP2"], step_layouts="TP1,TP3,2 x TP1", quick=True,
                              no_progress=True)
    out = cli_calibrate.steps_of(args)
    assert runs == [["TP1", "2 x TP1"], ["TP2"]] and list(out) == [llama.name]
    assert "TP3 skipped" in capsys.readouterr().err
    args.steps = [f"{llama}:TPX"]
    with pytest.raises(LayoutError):
        cli_calibrate.steps_of(args)
