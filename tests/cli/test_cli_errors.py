"""Bad input: one clear line on stderr, exit code 2, no traceback."""

import json
import shutil

import pytest

from atoll.cli.main import main


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


# (model, layout options, the error): checked against the model before any rank starts
LAYOUT_ERRORS = [
    ("llama", ["-tp", "3"], "tp=3 does not divide num_attention_heads=4"),
    ("llama", ["--layout", "TP2PP9"], "pp=9 exceeds num_hidden_layers"),
    ("mixtral", ["-tp", "2", "-ep", "4"], "ep=4 does not divide the stage's tp*dp=2 ranks"),
    ("mixtral", ["--layout", "TP4EP2MOETP4"], "ep*moe_tp=2*4=8 must equal tp*dp=4*1=4"),
    ("llama", ["--layout", "EP2"], "uses expert parallelism but llama is a dense model"),
    ("llama", ["-tp", "0"], "-tp 0 must be a whole number of at least 1"),
    ("llama", ["--layout", "TP2", "-tp", "1"], "give either --layout or the -tp/-pp/-dp/-ep sizes, not both"),
    ("llama", ["--launcher", "torchrun"], "--launcher torchrun needs torchrun's environment"),
]


@pytest.mark.parametrize("kind,options,error", LAYOUT_ERRORS)
def test_layout_the_model_cannot_take(capsys, tiny_model, kind, options, error):
    _fails(capsys, ["generate", "--model", str(tiny_model(kind)), "--prompt", "x", *options], error)


def _edited_copy(tiny_model, tmp_path, kind: str, edit) -> str:
    """A copy of a tiny model whose config.json went through edit(cfg)."""
    d = tmp_path / "m"
    shutil.copytree(tiny_model(kind), d)
    cfg = json.loads((d / "config.json").read_text())
    edit(cfg)
    (d / "config.json").write_text(json.dumps(cfg))
    return str(d)


def test_missing_shard_file(capsys, tiny_model, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), d)
    (d / "model.safetensors").unlink()
    _fails(capsys, ["generate", "--model", str(d), "--prompt", "x"], "no *.safetensors files")


def test_unsupported_architecture(capsys, tiny_model, tmp_path):
    d = _edited_copy(tiny_model, tmp_path, "llama",
                     lambda cfg: cfg.update(model_type="gpt2", architectures=["GPT2LMHeadModel"]))
    line = _fails(capsys, ["generate", "--model", d, "--prompt", "x"], "unsupported architecture 'GPT2LMHeadModel'")
    assert "llama" in line and "qwen3" in line


def test_prompt_longer_than_context(capsys, tiny_model, tmp_path):
    """A request the model cannot serve is that request's error line; no rank starts."""
    f = tmp_path / "p.jsonl"
    f.write_text(json.dumps({"id": 1, "prompt_token_ids": [3] * 300}) + "\n")
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tiny_model("llama")), "--prompts", str(f)])
    row = json.loads(capsys.readouterr().out)
    assert e.value.code == 1 and row["id"] == 1 and row["line"] == 1
    assert "prompt has 300 tokens; the context is 256" in row["error"]


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


def test_top_k_larger_than_experts(capsys, tiny_model, tmp_path):
    d = _edited_copy(tiny_model, tmp_path, "mixtral",
                     lambda cfg: cfg.update(num_experts_per_tok=cfg["num_local_experts"] + 1))
    _fails(capsys, ["generate", "--model", d, "--prompt", "x"], "must be between 1 and num_experts=4")
