"""Each rank reads only its slice of its stage's tensors; bad checkpoints fail clearly."""

import json
import re

import pytest
from safetensors import safe_open

from atoll.engine.rank.run_spec import RunSpec
from atoll.engine.rank.runner import ModelRunner
from atoll.errors import CheckpointError
from atoll.launch.local import run_local
from atoll.models.checkpoint import Checkpoint
from atoll.models.config import ModelConfig
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext
from atoll.parallel.pipeline import stage_layers


def _read(rank, world, spec):
    runner = ModelRunner(spec, ParallelContext.create(Layout.parse(spec.layout), rank))
    ck = runner.checkpoint
    return ck.bytes_read, sorted(ck.tensors_read)


def _stage_of(name, bounds):
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        i = int(m.group(1))
        return next(s for s, (a, b) in enumerate(bounds) if a <= i < b)
    return 0 if "embed_tokens" in name else len(bounds) - 1


@pytest.mark.timeout(240)
def test_each_rank_reads_its_slice(tiny_model):
    d = tiny_model("llama", num_hidden_layers=6, num_key_value_heads=4)
    cfg = ModelConfig.load(d)
    layout = Layout(tp=2, pp=2)
    bounds = stage_layers(cfg, layout.pp)
    sizes = {}
    with safe_open(str(d / "model.safetensors"), "pt") as f:
        for name in f.keys():
            t = f.get_slice(name)
            n = 4
            for s in t.get_shape():
                n *= s
            sizes[name] = n
    stage_bytes = [sum(n for k, n in sizes.items() if _stage_of(k, bounds) == s) for s in range(layout.pp)]
    out = run_local(_read, 4, RunSpec.of(str(d), str(layout), max_model_len=64), timeout_s=200)
    for rank, (nbytes, names) in enumerate(out):
        stage = rank // layout.tp
        assert {_stage_of(n, bounds) for n in names} == {stage}, f"rank {rank} read another stage's tensors"
        share = nbytes / stage_bytes[stage]
        # half of the sharded weights plus the small replicated norms
        assert 0.45 < share < 0.55, f"rank {rank} read {share:.2f} of its stage"
    for stage in range(layout.pp):
        both = sum(out[r][0] for r in range(stage * 2, stage * 2 + 2))
        assert both < 1.05 * stage_bytes[stage]


def test_missing_shard_is_named(tiny_model, tmp_path):
    d = tiny_model("llama")
    (tmp_path / "config.json").write_text((d / "config.json").read_text())
    index = {"metadata": {}, "weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="shard model-00002-of-00002.safetensors .* is missing"):
        Checkpoint(tmp_path)


def test_corrupt_header_is_named(tmp_path):
    (tmp_path / "model.safetensors").write_bytes(b"\xff" * 8 + b"not a header")
    with pytest.raises(CheckpointError, match="corrupt safetensors header"):
        Checkpoint(tmp_path).check()
