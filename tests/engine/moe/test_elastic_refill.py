"""engine/rank/elastic.py in one process on a tiny Qwen3-MoE of random weights with EPLB: an
orphaned expert read again from the checkpoint into a spare slot gives the layer the same
output, and an expert the checkpoint lacks has no source (the one-line error)."""

import pytest
import torch
from safetensors.torch import load_file, save_file

from atoll.comm.elastic import Load, Survival, survive_layers
from atoll.comm.eplb import Placement
from atoll.config import EngineConfig
from atoll.engine.rank.elastic import checkpoint_has, refill
from atoll.errors import ExpertLost
from atoll.models import ModelConfig, build_model
from atoll.models.checkpoint import Checkpoint, load_weights
from atoll.parallel.mesh import ParallelContext

E, R = 8, 4


@pytest.fixture(scope="module")
def loaded(tiny_model):
    model_dir = tiny_model("qwen3_moe", num_experts=E)
    engine = EngineConfig(enable_eplb=True, num_redundant_experts=R)
    model = build_model(ModelConfig.load(model_dir), ParallelContext.single(), engine=engine).eval()
    ckpt = Checkpoint(model_dir)
    load_weights(model, ckpt)
    return model_dir, model, ckpt


def test_an_orphan_loaded_into_a_spare_slot_computes_the_same(loaded):
    _, model, ckpt = loaded
    layer, moe = model.moe_layer_ids[0], model.moe_layers[0]
    assert moe.placement.phy2log == tuple(p % E for p in range(E + R))  # slots 8..11 copy experts 0..3
    x = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = moe(x)
        want = [t[5].clone() for t in moe.experts.slot_tensors()]
        for t in moe.experts.slot_tensors():
            t[8].zero_()  # slot 8 (a copy of expert 0) as a survivor's spare, about to take expert 5
    phy2log = list(moe.placement.phy2log)
    phy2log[8] = 5
    keep = {lid: Survival(m.placement, (0,), ()) for lid, m in zip(model.moe_layer_ids, model.moe_layers)}
    keep[layer] = Survival(Placement(tuple(phy2log), (E + R,), E), (0,), (Load(0, 8, 5),))
    written = refill(model, ckpt, keep, 0)
    assert written == sum(t[8].numel() * t.element_size() for t in moe.experts.slot_tensors())
    for t, w in zip(moe.experts.slot_tensors(), want):
        torch.testing.assert_close(t[8], w, rtol=0, atol=0)  # the checkpoint's weights, as slot 5's
    assert moe.experts.logical[8] == 5 and moe.placement.copies()[5] == [5, 8]
    with torch.no_grad():
        torch.testing.assert_close(moe(x), before, rtol=1e-5, atol=1e-6)


def test_an_expert_the_checkpoint_lacks_has_no_source(loaded, tmp_path):
    model_dir, model, ckpt = loaded
    assert checkpoint_has(model, ckpt)(model.moe_layer_ids[1], 6)
    tensors = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        tensors |= load_file(f)
    prefix = f"model.layers.{model.moe_layer_ids[1]}.mlp.experts.6."
    gone = [n for n in tensors if n.startswith(prefix)]
    assert gone
    for f in model_dir.iterdir():
        if f.suffix == ".json" and "index" not in f.name:
            (tmp_path / f.name).write_bytes(f.read_bytes())
    save_file({n: t for n, t in tensors.items() if n not in gone}, tmp_path / "model.safetensors")
    partial = Checkpoint(tmp_path)
    has = checkpoint_has(model, partial)
    assert not has(model.moe_layer_ids[1], 6) and has(model.moe_layer_ids[1], 5) and has(model.moe_layer_ids[0], 6)
    # EP4 of 12 slots: rank 2 alone holds 6 and 7 ([6, 7, 0]); lose it. Layer 0's expert 6 is
    # loaded again; layer 1's has no source
    placements = {lid: Placement.initial(E, R, 4) for lid in model.moe_layer_ids}
    assert placements[model.moe_layer_ids[1]].local(2) == [6, 7, 0]
    with pytest.raises(ExpertLost) as err:
        survive_layers(placements, {2}, has)
    msg = str(err.value)
    assert msg.startswith(f"expert 6 of MoE layer {model.moe_layer_ids[1]} has no source") and "\n" not in msg
    assert survive_layers({model.moe_layer_ids[0]: placements[model.moe_layer_ids[0]]}, {2}, has)
