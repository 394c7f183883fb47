"""A corrupt checkpoint is one CheckpointError line naming the file and the tensor, found from
the safetensors headers before any rank starts: a tensor the index maps to a shard that does
not hold it, shapes that disagree with config.json (embedding, head, a layer's weight, an
expert the layout's checked ranks do not hold), a missing shard, a truncated file. `LLM(dir)`
raises it; `atoll generate` prints it as `atoll: error: ...` and exits 2, no traceback."""

import json
import os
import re
import shutil
from multiprocessing.process import BaseProcess

import pytest
import torch
from cli import run_cli
from procs import spawned_children
from safetensors.torch import load_file, save_file

from atoll import LLM
from atoll.errors import CheckpointError

INDEX = "model.safetensors.index.json"
EMBED, HEAD, NORM = "model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"
Q = "model.layers.1.self_attn.q_proj.weight"
EXPERT = "model.layers.1.mlp.experts.1.gate_proj.weight"  # at EP4, rank 1's: not a checked end rank


def _resize(name, rows=None, cols=None):
    """A change that cuts or pads tensor `name` to `rows` x `cols`."""
    def change(t):
        w = t[name]
        out = torch.zeros(rows or w.shape[0], cols or w.shape[1])
        r, c = min(out.shape[0], w.shape[0]), min(out.shape[1], w.shape[1])
        out[:r, :c] = w[:r, :c]
        t[name] = out
    return change


def _tie(t):
    t.pop(HEAD)


# id: (model kind, layout, change(tensors), config changes, tensor named, text the line holds)
SHAPES = {
    # the case: vocab 100 stored against 128 in config.json (was a RuntimeError)
    "embedding-short": ("llama", "TP2", _resize(EMBED, rows=100), {}, EMBED,
                        "stores it as (100, 64), the config gives it (128, 64)"),
    "embedding-long": ("llama", "TP1", _resize(EMBED, rows=136), {}, EMBED,
                       "stores it as (136, 64), the config gives it (128, 64)"),
    "head-short": ("llama", "TP2PP2", _resize(HEAD, rows=100), {}, HEAD,
                   "stores it as (100, 64), the config gives it (128, 64)"),
    "head-long": ("llama", "TP2", _resize(HEAD, rows=136), {}, HEAD,
                  "stores it as (136, 64), the config gives it (128, 64)"),
    "head-hidden": ("llama", "TP2", _resize(HEAD, cols=60), {}, HEAD, "stores it as (128, 60)"),
    "q_proj-rows": ("llama", "TP2", _resize(Q, rows=48), {}, Q,
                    "stores it as (48, 64), the config gives it (64, 64)"),
    "q_proj-cols": ("llama", "TP1", _resize(Q, cols=72), {}, Q, "stores it as (64, 72)"),
    "tied-embedding-short": ("llama", "TP2", lambda t: (_tie(t), _resize(EMBED, rows=100)(t)),
                             {"tie_word_embeddings": True}, EMBED,
                             "stores it as (100, 64), the config gives it (128, 64)"),
    "expert-rows": ("qwen3_moe", "EP4", _resize(EXPERT, rows=24), {}, EXPERT,
                    "stores it as (24, 64), the config gives it (32, 64)"),
}


def _write(tensors, dst, shards):
    """tensors as dst/model.safetensors, or as `shards` files with an index (in name order)."""
    if shards == 1:
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
        return
    names = sorted(tensors)
    files = [f"model-{i + 1:05d}-of-{shards:05d}.safetensors" for i in range(shards)]
    weight_map = {}
    for i, f in enumerate(files):
        part = names[i * len(names) // shards:(i + 1) * len(names) // shards]
        save_file({n: tensors[n] for n in part}, dst / f, metadata={"format": "pt"})
        weight_map |= {n: f for n in part}
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    (dst / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}))


def _copy(src, dst, *, change=None, config=None, shards=1):
    """Checkpoint src rewritten at dst with change(tensors) and config.json updated by `config`."""
    dst.mkdir(parents=True)
    for f in src.glob("*.json"):
        shutil.copy(f, dst / f.name)
    tensors = load_file(src / "model.safetensors")
    if change is not None:
        change(tensors)
    _write(tensors, dst, shards)
    if config:
        cfg = json.loads((dst / "config.json").read_text())
        (dst / "config.json").write_text(json.dumps({**cfg, **config}))
    return dst


def _last_tensor(path):
    """The tensor whose bytes end the safetensors file at path (what a cut at the end loses)."""
    raw = path.read_bytes()
    header = json.loads(raw[8:8 + int.from_bytes(raw[:8], "little")])
    header.pop("__metadata__", None)
    return max(header, key=lambda k: header[k]["data_offsets"][1])


def _misplace(d):
    """The index maps model.norm.weight to the shard that does not hold it."""
    index = json.loads((d / INDEX).read_text())
    files = sorted(set(index["weight_map"].values()))
    held = index["weight_map"][NORM]
    wrong = next(f for f in files if f != held)
    index["weight_map"][NORM] = wrong
    (d / INDEX).write_text(json.dumps(index))
    return f"{INDEX} maps tensor {NORM} to {wrong}, which does not hold it (it is in {held})", NORM


def _drop_shard(d):
    index = json.loads((d / INDEX).read_text())
    gone = "model-00002-of-00002.safetensors"
    (d / gone).unlink()
    first = sorted(n for n, f in index["weight_map"].items() if f == gone)[0]
    return f"shard {gone} listed in {INDEX} for tensor {first} and ", first


def _cut_data(d):
    """The last file loses 100 bytes: its header promises more than the file holds."""
    f = sorted(d.glob("*.safetensors"))[-1]
    name = _last_tensor(f)
    raw = f.read_bytes()
    f.write_bytes(raw[:-100])
    return f"{f.name} is truncated: tensor {name} ends at byte {len(raw)}, the file has {len(raw) - 100} bytes", name


def _cut_header(d):
    """The last file is cut inside its JSON header: no tensor can be named, the file is."""
    f = sorted(d.glob("*.safetensors"))[-1]
    f.write_bytes(f.read_bytes()[:40])
    return f"{f.name} is truncated inside its header: the header is ", None


# id: (shard files, break(dir) -> (text the line holds, tensor named or None))
FILES = {
    "index-wrong-shard": (2, _misplace),
    "missing-shard": (2, _drop_shard),
    "truncated-data": (1, _cut_data),
    "truncated-data-sharded": (2, _cut_data),
    "truncated-header": (1, _cut_header),
    "truncated-header-sharded": (2, _cut_header),
}

CASES = [pytest.param(("shape", k, s), id=f"{k}-{'sharded' if s > 1 else 'single'}")
         for k in SHAPES for s in (1, 2)] + [pytest.param(("file", k, 0), id=k) for k in FILES]


@pytest.fixture(scope="module")
def corrupt(tiny_model, tmp_path_factory):
    """case -> (checkpoint dir, layout, text its line must hold, tensor it must name), built once."""
    made = {}

    def build(case):
        if case not in made:
            kind, key, shards = case
            dst = tmp_path_factory.mktemp("corrupt") / key
            if kind == "shape":
                family, layout, change, config, name, text = SHAPES[key]
                d = _copy(tiny_model(family, vocab_size=128), dst, change=change, config=config, shards=shards)
                made[case] = d, layout, f"tensor {name} does not fit the model config", name, text
            else:
                shards, breaks = FILES[key]
                d = _copy(tiny_model("llama", vocab_size=128), dst, shards=shards)
                text, name = breaks(d)
                made[case] = d, "TP2", text, name, None
        return made[case]

    return build


@pytest.fixture
def no_ranks(monkeypatch):
    """Fails the test if a rank process is started (every launcher's local ranks go through
    multiprocessing's Process.start); afterwards, checks /proc for spawned children too."""
    def start(self):
        raise AssertionError(f"a rank process was started: {self.name}")

    monkeypatch.setattr(BaseProcess, "start", start)
    yield
    assert spawned_children(os.getpid()) == []


def _check_line(line, d, text, name, extra):
    assert "\n" not in line
    assert text in line
    assert extra is None or extra in line
    assert name is None or name in line
    assert str(d) in line  # the file, by its path in the checkpoint directory


@pytest.mark.parametrize("case", CASES)
def test_llm_raises_one_line_naming_file_and_tensor(corrupt, no_ranks, case):
    d, layout, text, name, extra = corrupt(case)
    with pytest.raises(CheckpointError) as e:
        LLM(d, layout=layout, device="cpu")
    _check_line(str(e.value), d, text, name, extra)


@pytest.mark.parametrize("case", CASES)
def test_generate_prints_one_line_and_exits_2(corrupt, no_ranks, capsys, case):
    d, layout, text, name, extra = corrupt(case)
    code, out, err = run_cli(capsys, "generate", "--model", d, "--prompt", "hi", "--layout", layout,
                             "--device", "cpu", "--no-progress")
    assert code == 2
    assert out == ""
    assert "Traceback" not in err
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("atoll: error: "), err
    _check_line(lines[0], d, text, name, extra)


def test_the_shape_check_is_silent_on_good_checkpoints(tiny_model, tmp_path, no_ranks):
    """The same writer, unchanged, single-file and sharded, tied and untied, dense and MoE."""
    for shards in (1, 2):
        _copy(tiny_model("llama", vocab_size=128), tmp_path / f"llama{shards}", shards=shards)
        LLM(tmp_path / f"llama{shards}", layout="TP2", device="cpu")
    _copy(tiny_model("llama", vocab_size=128), tmp_path / "tied", change=_tie, config={"tie_word_embeddings": True})
    LLM(tmp_path / "tied", layout="TP2PP2", device="cpu")
    _copy(tiny_model("qwen3_moe", vocab_size=128), tmp_path / "moe", shards=2)
    LLM(tmp_path / "moe", layout="EP4", device="cpu")


def test_a_shape_is_named_on_the_ranks_too(tiny_model, tmp_path):
    """Loading past the header check (another engine's own loader): reading past a tensor's
    stored end is the same one line, not a shorter slice."""
    from atoll.models.checkpoint import Checkpoint

    d = _copy(tiny_model("llama", vocab_size=128), tmp_path / "m", change=_resize(EMBED, rows=100))
    src = Checkpoint(d).get(EMBED)
    assert src[0:64].shape == (64, 64)
    with pytest.raises(CheckpointError, match=re.escape(f"tensor {EMBED} does not fit the model config: "
                                                        f"{d / 'model.safetensors'} stores it as (100, 64), "
                                                        "the model reads dim 0 to 128")):
        src[64:128]
