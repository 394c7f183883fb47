"""Issue 12: every user error is one line `atoll: error: ...`, exit code 2, no traceback;
`convert --force` never deletes a directory it did not make (what each command imports:
test_cli_imports.py)."""

import json
import math
import shutil
import subprocess
import sys

import pytest

from atoll.cli.main import main
from atoll.models import gguf


def _fails(capsys, argv, pattern):
    """`atoll ARGV` exits 2 with one line naming `pattern`, and nothing else on stderr."""
    capsys.readouterr()  # drop what fixtures printed (building tiny models)
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    out = capsys.readouterr()
    lines = out.err.strip().splitlines()
    assert e.value.code == 2, out.err
    assert len(lines) == 1 and lines[0].startswith("atoll: error: "), out.err
    assert pattern in lines[0], lines[0]
    return lines[0], out.out


# --- argparse's own errors: one line, no usage dump ---

ARGPARSE_ERRORS = [
    (["generate", "--model", "m", "--prompt", "x", "-tp", "abc"], "-tp: 'abc' is not a whole number"),
    (["generate", "--model", "m", "--prompt", "x", "--seed", "abc"], "--seed: 'abc' is not a whole number"),
    (["generate", "--model", "m", "--prompt", "x", "--dtype", "int3"], "invalid choice: 'int3' (choose from"),
    (["generate", "--model", "m", "--prompt", "x", "--temperature", "hot"], "'hot' is not a number"),
    (["generate", "--model", "m", "--prompt", "x", "--bogus"], "unrecognized arguments: --bogus"),
    (["generate", "--prompt", "x"], "generate: the following arguments are required: --model"),
    (["generate", "--model", "m", "--prompt", "x", "--prompts", "p"], "not allowed with argument --prompt"),
    (["plan", "--model", "Llama-3.1-8B"], "plan: the following arguments are required: --topology"),
    (["plan", "--model", "Llama-3.1-8B", "--topology", "dgx-h200", "--isl", "1.5"], "'1.5' is not a whole"),
    (["convert", "m.gguf", "out", "--dtype", "int3"], "convert: argument --dtype: invalid choice"),
    (["topo", "--nodes", "two"], "topo: argument --nodes: 'two' is not a whole number"),
    (["frobnicate"], "invalid choice: 'frobnicate'"),
    ([], "the following arguments are required: COMMAND"),
]


@pytest.mark.parametrize("argv,error", ARGPARSE_ERRORS)
def test_argparse_errors_are_one_line(capsys, argv, error):
    line, _ = _fails(capsys, argv, error)
    assert "usage:" not in line and "--help" in line  # where the valid options are


def test_argparse_error_from_a_real_process():
    r = subprocess.run([sys.executable, "-m", "atoll", "generate", "--model", "m", "--prompt", "x",
                        "-tp", "abc"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr.count("\n") == 1 and r.stderr.startswith("atoll: error: generate: argument"), r.stderr


# --- convert: --force replaces only what convert made ---


@pytest.fixture
def fake_convert(tmp_path, monkeypatch):
    """A GGUF-looking file, and a conversion that writes one file, so the policy runs fast."""
    src = tmp_path / "m.gguf"
    src.write_bytes(b"GGUF" + bytes(64))

    def convert_into(gguf_path, tmp, dtype, bar):
        (tmp / "config.json").write_text('{"converted": true}')

    monkeypatch.setattr(gguf, "_convert_into", convert_into)
    monkeypatch.setattr(gguf, "_require_convert_packages", lambda: None)
    return src


def test_force_never_deletes_a_directory_convert_did_not_make(capsys, tmp_path, fake_convert):
    mine = tmp_path / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "sub" / "thesis.tex").write_text("years of work")
    (mine / "config.json").write_text("{}")  # looks like a checkpoint, but convert did not make it
    _fails(capsys, ["convert", fake_convert, mine, "--force"], f"{mine} was not made by atoll convert")
    assert (mine / "sub" / "thesis.tex").read_text() == "years of work"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m.gguf", "mine"]


def test_force_replaces_what_convert_made(capsys, tmp_path, fake_convert):
    out = tmp_path / "out"
    assert main_ok(capsys, ["convert", fake_convert, out]) == str(out)
    marker = json.loads((out / gguf.MARKER).read_text())
    assert marker["source"] == "m.gguf" and marker["dtype"] == "float32"
    (out / "stale.txt").write_text("from the first conversion")
    _fails(capsys, ["convert", fake_convert, out], "already exists; remove it or pass --force")
    assert main_ok(capsys, ["convert", fake_convert, out, "--force"]) == str(out)
    assert sorted(p.name for p in out.iterdir()) == sorted(["config.json", gguf.MARKER])
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main_ok(capsys, ["convert", fake_convert, empty, "--force"]) == str(empty)
    assert (empty / gguf.MARKER).is_file()


def main_ok(capsys, argv) -> str:
    with pytest.raises(SystemExit) as e:
        main([str(a) for a in argv])
    out = capsys.readouterr()
    assert e.value.code == 0, out.err
    return out.out.strip()


def test_convert_into_a_file_or_under_one(capsys, tmp_path, fake_convert):
    f = tmp_path / "notes.txt"
    f.write_text("keep me")
    _fails(capsys, ["convert", fake_convert, f, "--force"], f"OUT_DIR {f} is a file, not a directory")
    _fails(capsys, ["convert", fake_convert, f / "out"], f"cannot create {f / 'out'}: {f} is a file")
    _fails(capsys, ["convert", fake_convert, f / "a" / "b", "--force"], f"{f} is a file")
    assert f.read_text() == "keep me"


def test_demo_reconvert_replaces_an_old_cache_but_nothing_else(capsys, tmp_path, monkeypatch,
                                                               fake_convert):
    monkeypatch.setenv("ATOLL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(gguf, "demo_gguf_path", lambda: fake_convert)
    cached = tmp_path / "cache" / gguf.DEMO_NAME
    cached.mkdir(parents=True)
    for name in ("config.json", "model.safetensors", "tokenizer.json"):  # an earlier atoll's cache
        (cached / name).write_text("old")
    assert main_ok(capsys, ["convert", "--demo", "--force"]) == str(cached)
    assert (cached / gguf.MARKER).is_file()
    (cached / gguf.MARKER).unlink()
    (cached / "my-notes.md").write_text("not atoll's")
    _fails(capsys, ["convert", "--demo", "--force"], "was not made by atoll convert")
    assert (cached / "my-notes.md").is_file()


def test_the_real_conversion_carries_the_marker(smollm2_dir):
    assert json.loads((smollm2_dir / gguf.MARKER).read_text())["source"].endswith(".gguf")


# --- checkpoint files: one line naming the file ---


@pytest.fixture
def model_copy(tiny_model, tmp_path):
    d = tmp_path / "m"
    shutil.copytree(tiny_model("llama"), d)
    return d


def _generate_fails(capsys, model, pattern, *extra):
    return _fails(capsys, ["generate", "--model", model, "--prompt", "hi", *extra], pattern)


def _write_tokenizer(d):
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<unk>": 0, "</s>": 1, "hi": 2, "there": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.save(str(d / "tokenizer.json"))


def test_corrupt_tokenizer_json(capsys, model_copy):
    (model_copy / "tokenizer.json").write_text('{"version": "1.0", "model": ')
    _generate_fails(capsys, model_copy, "tokenizer.json is not a valid tokenizers file")


@pytest.mark.parametrize("text,error", [
    ("{not json", "tokenizer_config.json is not valid JSON"),
    ('["a list"]', "tokenizer_config.json does not hold a JSON object"),
    ('{"eos_token": 5}', "tokenizer_config.json: eos_token=5 must be a token string"),
    ('{"chat_template": 7}', "chat_template must be a string"),
])
def test_corrupt_tokenizer_config(capsys, model_copy, text, error):
    _write_tokenizer(model_copy)
    (model_copy / "tokenizer_config.json").write_text(text)
    _generate_fails(capsys, model_copy, error)


@pytest.mark.parametrize("text,error", [
    ("{oops", "generation_config.json is not valid JSON"),
    ("3", "generation_config.json does not hold a JSON object"),
    ('{"eos_token_id": "</s>"}', "eos_token_id=['</s>'] must be a token id"),
])
def test_corrupt_generation_config(capsys, model_copy, text, error):
    (model_copy / "generation_config.json").write_text(text)
    _generate_fails(capsys, model_copy, error)


@pytest.mark.parametrize("index,error", [
    ({"weight_map": ["model.safetensors"]}, "weight_map must be a non-empty JSON object"),
    ({"weight_map": {"lm_head.weight": 3}}, "weight_map value 3 is not a shard file name"),
    ({"metadata": {}}, "is not a valid safetensors index"),
])
def test_bad_safetensors_index(capsys, model_copy, index, error):
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    _generate_fails(capsys, model_copy, error)


def test_config_json_that_is_a_directory(capsys, model_copy):
    (model_copy / "config.json").unlink()
    (model_copy / "config.json").mkdir()
    _generate_fails(capsys, model_copy, "config.json is a directory, not a config.json file")
    _fails(capsys, ["plan", "--model", model_copy, "--topology", "dgx-h200"], "is a directory")


@pytest.mark.parametrize("text,error", [
    ("not json", "config.json is not valid JSON"),
    ("[1, 2]", "config.json does not hold a JSON object"),
])
def test_config_json_not_an_object(capsys, model_copy, text, error):
    (model_copy / "config.json").write_text(text)
    _generate_fails(capsys, model_copy, error)


def _edit_config(d, **fields):
    cfg = json.loads((d / "config.json").read_text())
    cfg.update(fields)
    cfg.pop("head_dim", None)
    (d / "config.json").write_text(json.dumps(cfg))


@pytest.mark.parametrize("fields,error", [
    (dict(num_attention_heads=0), "num_attention_heads=0 must be a whole number >= 1"),
    (dict(num_attention_heads="4"), "num_attention_heads='4' must be a whole number >= 1"),
    (dict(hidden_size=None), "hidden_size=None must be a whole number >= 1"),
    (dict(num_hidden_layers=-2), "num_hidden_layers=-2 must be a whole number >= 1"),
    (dict(rms_norm_eps=None), "rms_norm_eps=None must be a finite number"),
    (dict(rope_theta="big"), "rope_theta='big' must be a number"),
    (dict(rope_scaling="yarn"), "rope_scaling='yarn' must be a JSON object or null"),
    (dict(eos_token_id=["</s>"]), "eos_token_id=['</s>'] must be whole numbers"),
])
def test_bad_config_fields_in_generate_and_plan(capsys, model_copy, fields, error):
    _edit_config(model_copy, **fields)
    line, _ = _generate_fails(capsys, model_copy, error)
    assert str(model_copy / "config.json") in line  # names the file
    _fails(capsys, ["plan", "--model", model_copy, "--topology", "dgx-h200"], error)


def test_moe_config_with_null_sizes(capsys, tiny_model, tmp_path):
    d = tmp_path / "ds"
    shutil.copytree(tiny_model("deepseek_v3"), d)
    _edit_config(d, moe_intermediate_size=None)
    _fails(capsys, ["plan", "--model", d, "--topology", "dgx-h200"], "has a field of the wrong type")
    _edit_config(d, moe_intermediate_size=32, num_experts_per_tok=None)
    _fails(capsys, ["plan", "--model", d, "--topology", "dgx-h200"], "num_experts_per_tok=None")


# --- plan and topo ---

PLAN = ["plan", "--model", "Llama-3.1-8B", "--topology", "dgx-h200"]


def test_plot_into_a_missing_directory_fails_before_the_table(capsys, tmp_path):
    png = tmp_path / "no" / "such" / "plan.png"
    _, out = _fails(capsys, [*PLAN, "--plot", png], "the directory")
    assert out == ""  # nothing was computed or printed
    f = tmp_path / "file"
    f.write_text("")
    _fails(capsys, [*PLAN, "--plot", f / "plan.png"], "is a file")
    _fails(capsys, [*PLAN, "--plot", tmp_path], "is a directory")
    _fails(capsys, [*PLAN, "--plot", tmp_path / "plan.docx"], "cannot write .docx files")


@pytest.mark.parametrize("flag,value", [("--ttft-ms", "nan"), ("--tpot-ms", "0"), ("--ttft-ms", "-5"),
                                        ("--tpot-ms", "inf")])
def test_slo_must_be_positive(capsys, flag, value):
    _fails(capsys, [*PLAN, flag, value], f"{flag} {float(value)}: an SLO must be a positive number")


def test_gpus_per_node_beyond_the_node(capsys):
    _fails(capsys, [*PLAN, "--gpus-per-node", "99"], "gpus_per_node=99 exceeds the 8 GPUs per node")


def test_absurd_node_count_fails_at_once(capsys):
    _fails(capsys, [*PLAN, "--nodes", "100000000"], "atoll describes at most")


def test_topo_from_smi_on_a_binary_file(capsys, tmp_path):
    f = tmp_path / "smi.bin"
    f.write_bytes(bytes(range(256)) * 4)
    _fails(capsys, ["topo", "--from-smi", f], f"{f} is not text")
    f.write_bytes(b"GPU0\x00\x00X\n")
    _fails(capsys, ["topo", "--from-smi", f], "is not text")


TOPOLOGY = dict(name="t", gpus_per_node=8, islands=8,
                gpu=dict(name="H100", memory_gib=80, hbm_tb_s=3.35, bf16_tflops=989),
                links=dict(nvlink=dict(gb_s=450, latency_us=3), pcie=dict(gb_s=64, latency_us=5),
                           network=dict(kind="infiniband", gb_s=50, latency_us=5)))


def _topology_file(tmp_path, **edits):
    import yaml

    d = json.loads(json.dumps(TOPOLOGY))
    for path, value in edits.items():
        *parents, last = path.split("__")
        node = d
        for p in parents:
            node = node[p]
        node[last] = value
    f = tmp_path / "cluster.yaml"
    f.write_text(yaml.safe_dump(d))
    return f


@pytest.mark.parametrize("edits,error", [
    (dict(islands=["0123", "4567"]), "must be lists of local GPU numbers"),
    (dict(islands="eight"), "islands='eight' must be a GPU count"),
    (dict(islands=[[0, 1, 2, 3], [4, 5, 6, "7"]]), "must be lists of local GPU numbers"),
    (dict(islands=[0, 1]), "must be lists of local GPU numbers"),
    (dict(links__nvlink__gb_s=math.nan), "links.nvlink: nvlink link: gb_s=nan must be a positive number"),
    (dict(links__network__gb_s=-50), "gb_s=-50 must be a positive number"),
    (dict(links__pcie__gb_s=math.inf), "gb_s=inf must be a positive number"),
    (dict(links__network__latency_us=math.nan), "latency_us=nan must be a number >= 0"),
    (dict(links__network__shared="no"), "shared='no' must be true or false"),
    (dict(gpu__hbm_tb_s=math.nan), "hbm_tb_s=nan must be a positive number"),
    (dict(gpu__fp8_tflops=-1), "fp8_tflops=-1 must be a number >= 0"),
    (dict(node_names="node0"), "node_names='node0' must be a list"),
])
def test_bad_topology_yaml(capsys, tmp_path, edits, error):
    f = _topology_file(tmp_path, **edits)
    line, _ = _fails(capsys, ["topo", f], error)
    assert "cluster.yaml" in line  # names the file
    _fails(capsys, ["plan", "--model", "Llama-3.1-8B", "--topology", f], error)


def test_binary_topology_file(capsys, tmp_path):
    f = tmp_path / "cluster.yaml"
    f.write_bytes(b"\xff\xfe\x00binary")
    _fails(capsys, ["topo", f], "cluster.yaml: not a text file")


def test_topo_gpu_flag_without_from_smi(capsys):
    _fails(capsys, ["topo", "dgx-h200", "--gpu", "H100"], "--gpu H100 applies only to --from-smi")


def test_a_multi_line_user_error_prints_as_one_line(capsys, monkeypatch):
    from atoll.errors import ConfigError
    from atoll.cli import topo as cmd_topo

    def run(args):
        raise ConfigError("first part\n  second part\n")

    monkeypatch.setattr(cmd_topo, "run", run)
    _fails(capsys, ["topo", "--list"], "first part second part")
