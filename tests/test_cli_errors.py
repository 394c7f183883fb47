"""Bad input: one clear line on stderr, exit code 2, no traceback."""

import json
import shutil

import pytest

from atoll.launch.cli import main


def _fails(capsys, argv, pattern):
    with pytest.raises(SystemExit) as e:
        main(argv)
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.startswith("atoll: error:")]
    assert len(lines) == 1, err
    assert pattern in lines[0], lines[0]
    return lines[0]


def test_tp_not_dividing_heads(capsys, tiny_model):
    _fails(capsys, ["generate", "--model", str(tiny_model("llama")), "--prompt", "x", "-tp", "3"],
           "tp=3 does not divide num_attention_heads=4")


def test_too_many_stages(capsys, tiny_model):
    _fails(capsys, ["generate", "--model", str(tiny_model("llama")), "--prompt", "x", "--layout", "TP2PP9"],
           "pp=9 exceeds num_hidden_layers")


def test_missing_shard_file(capsys, tiny_model, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), d)
    (d / "model.safetensors").unlink()
    _fails(capsys, ["generate", "--model", str(d), "--prompt", "x"], "no *.safetensors files")


def test_unsupported_architecture(capsys, tiny_model, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"])
    (d / "config.json").write_text(json.dumps(cfg))
    line = _fails(capsys, ["generate", "--model", str(d), "--prompt", "x"], "unsupported architecture 'GPT2LMHeadModel'")
    assert "llama" in line and "qwen3" in line


def test_prompt_longer_than_context(capsys, tiny_model, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": 1, "prompt_token_ids": [3] * 300}) + "\n")
    _fails(capsys, ["generate", "--model", str(tiny_model("llama")), "--prompts", str(f)],
           "prompt 0 has 300 tokens; the context is 256")


def test_empty_prompt_file(capsys, tiny_model, tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text("\n")
    _fails(capsys, ["generate", "--model", str(tiny_model("llama")), "--prompts", str(f)], "is empty")


def test_corrupt_safetensors_header(capsys, tiny_model, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), d)
    (d / "model.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{broken json!!!}")
    _fails(capsys, ["generate", "--model", str(d), "--prompt", "x"], "corrupt safetensors header")


def test_missing_model_dir(capsys, tmp_path):
    _fails(capsys, ["generate", "--model", str(tmp_path / "nope"), "--prompt", "x"], "no config.json")


def test_ep_not_dividing_the_stage(capsys, tiny_model):
    _fails(capsys, ["generate", "--model", str(tiny_model("mixtral")), "--prompt", "x", "-tp", "2", "-ep", "4"],
           "ep=4 does not divide the stage's tp*dp=2 ranks")


def test_moe_tp_inconsistent(capsys, tiny_model):
    _fails(capsys, ["generate", "--model", str(tiny_model("mixtral")), "--prompt", "x", "--layout", "TP4EP2MOETP4"],
           "ep*moe_tp=2*4=8 must equal tp*dp=4*1=4")


def test_ep_on_a_dense_model(capsys, tiny_model):
    _fails(capsys, ["generate", "--model", str(tiny_model("llama")), "--prompt", "x", "--layout", "EP2"],
           "uses expert parallelism but llama is a dense model")


def test_top_k_larger_than_experts(capsys, tiny_model, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_model("mixtral"), d)
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_experts_per_tok"] = cfg["num_local_experts"] + 1
    (d / "config.json").write_text(json.dumps(cfg))
    _fails(capsys, ["generate", "--model", str(d), "--prompt", "x"], "must be between 1 and num_experts=4")
