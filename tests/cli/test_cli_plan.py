"""`atoll plan` and `atoll topo` through the CLI entry point: output formats and bad input."""

import csv
import io
import json

import pytest

from atoll.cli.main import main

from paths import DATA  # noqa: E402


def run(capsys, *argv):
    with pytest.raises(SystemExit) as e:
        main(list(argv))
    out, err = capsys.readouterr()
    return e.value.code, out, err


def error_line(capsys, *argv):
    code, out, err = run(capsys, *argv)
    assert code == 2, (out, err)
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("atoll: error: ") and "Traceback" not in err
    return lines[0]


DS = ["plan", "--model", "DeepSeek-V3", "--topology", "dgx-h200", "--nodes", "2", "--dtype", "fp8"]


def test_table_names_recommendation_and_placement(capsys):
    code, out, _ = run(capsys, *DS, "--concurrency", "1", "--layouts", "TP8PP2,EP16,DP16EP16")
    assert code == 0
    assert "recommended TP8PP2" in out and "TTFT ms" in out and "tok/s/GPU" in out
    assert "node0: ranks 0-7, node1: ranks 8-15" in out


def test_sweep_reports_where_recommendation_changes(capsys):
    code, out, _ = run(capsys, *DS, "--concurrency", "1,1024", "--osl", "4096", "--layouts", "TP8PP2,DP16EP16")
    assert code == 0 and "1: TP8PP2; 1024: DP16EP16 (changes)" in out


def test_json_and_csv(capsys):
    code, out, _ = run(capsys, *DS, "--concurrency", "8", "--layouts", "TP8PP2,2x TP8", "--format", "json")
    d = json.loads(out)
    assert code == 0 and {p["name"] for p in d["predictions"]} == {"TP8PP2", "2 x TP8"}
    ranks = d["placement"]["ranks"]
    assert [r["node"] for r in ranks] == ["node0"] * len(ranks) if d["recommended"] == "2 x TP8" \
        else [r["node"] for r in ranks] == ["node0"] * 8 + ["node1"] * 8
    code, out, _ = run(capsys, *DS, "--concurrency", "1,8", "--layouts", "TP8PP2", "--format", "csv")
    rows = list(csv.DictReader(io.StringIO(out)))
    assert [r["concurrency"] for r in rows] == ["1", "8"] and rows[0]["recommended"] == "True"


def test_memory_shortfall_shown(capsys):
    code, out, _ = run(capsys, "plan", "--model", "DeepSeek-V3", "--topology", "dgx-h200",
                       "--gpus-per-node", "4", "--dtype", "fp8", "--concurrency", "1")
    assert code == 1 and "no layout fits in GPU memory" in out and "short" in out  # issue 14: exit 1


def test_model_from_hf_config_dir(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "llama", "vocab_size": 32000, "hidden_size": 2048, "intermediate_size": 5632,
        "num_hidden_layers": 22, "num_attention_heads": 32, "num_key_value_heads": 4}))
    code, out, _ = run(capsys, "plan", "--model", str(tmp_path), "--topology", "l40s-pcie", "--concurrency", "4")
    assert code == 0 and "recommended" in out


def test_plot_writes_png(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    png = tmp_path / "pareto.png"
    code, _, _ = run(capsys, *DS, "--concurrency", "1,64", "--plot", str(png))
    assert code == 0 and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_unknown_topology_lists_presets(capsys):
    line = error_line(capsys, "plan", "--model", "DeepSeek-V3", "--topology", "dgx-h300")
    assert "unknown topology 'dgx-h300'" in line and "dgx-h200" in line and "gb200-nvl72" in line


def test_unknown_model_lists_presets(capsys):
    line = error_line(capsys, "plan", "--model", "Llama-5", "--topology", "dgx-h200")
    assert "unknown model 'Llama-5'" in line and "DeepSeek-V3" in line and "Qwen3-235B-A22B" in line


def test_topology_yaml_missing_field(tmp_path, capsys):
    text = (DATA / "dgx-h100-eth25.yaml").read_text().replace("  pcie: {gb_s: 64, latency_us: 5}\n", "")
    (tmp_path / "bad.yaml").write_text(text)
    line = error_line(capsys, "plan", "--model", "Llama-3.1-8B", "--topology", str(tmp_path / "bad.yaml"))
    assert "bad.yaml: missing field 'links.pcie'" in line


def test_topology_yaml_gpu_count_not_matching_islands(tmp_path, capsys):
    text = (DATA / "dgx-h100-eth25.yaml").read_text().replace("islands: 8", "islands: [[0, 1, 2, 3], [4, 5, 6]]")
    (tmp_path / "bad.yaml").write_text(text)
    line = error_line(capsys, "topo", str(tmp_path / "bad.yaml"))
    assert "cover 7 GPUs but gpus_per_node is 8" in line


def test_model_config_without_needed_fields(tmp_path, capsys):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 32000}))
    line = error_line(capsys, "plan", "--model", str(tmp_path), "--topology", "dgx-h200")
    assert "lacks hidden_size, num_hidden_layers, num_attention_heads" in line


@pytest.mark.parametrize("argv", [
    ["plan", "--model", "DeepSeek-V3", "--topology", "dgx-h200", "--nodes", "0"],
    ["topo", "dgx-h200", "--nodes", "0"],
])
def test_nodes_below_one(capsys, argv):
    assert "--nodes 0: must be at least 1" in error_line(capsys, *argv)


def test_bad_concurrency_and_layout(capsys):
    assert "--concurrency '1,x'" in error_line(capsys, *DS, "--concurrency", "1,x")
    assert "tp=3 does not divide num_attention_heads=128" in error_line(capsys, *DS, "--layouts", "TP3")


def test_topo_preset_and_smi(capsys):
    code, out, _ = run(capsys, "topo", "gb200-nvl72", "--nodes", "36")
    assert code == 0 and "2 NVLink island(s) of 72 GPUs" in out and "node17:0-3 + node18" not in out
    code, out, _ = run(capsys, "topo", "--from-smi", str(DATA / "nvidia-smi-topo/nvlink-pairs-4gpu-a30.txt"))
    assert code == 0 and "island 1: 2 GPU(s)  node0:2-3" in out
    code, out, _ = run(capsys, "topo", "dgx-h100", "--format", "json")
    assert json.loads(out)["links"]["network"]["kind"] == "infiniband"
    assert "give exactly one of" in error_line(capsys, "topo")
