"""DeepSeek-V3 and V2 end to end: MLA attention over the latent paged cache, dense then MoE
layers, against transformers; the latent cache's bytes against the planner's; the preset
against a config directory."""

import json

import pytest
import torch
from reference import reference_tokens

from atoll import LLM, SamplingParams
from atoll.layers.attention import AttentionMetadata
from atoll.models import build_model
from atoll.engine.kv.sizing import kv_bytes_per_block
from atoll.engine.rank.kv_cache import make_cache
from atoll.models.checkpoint import Checkpoint, load_weights
from atoll.models.config import ModelConfig
from atoll.models.presets import PRESETS, resolve_model
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext
from atoll.parallel.pipeline import stage_layers

PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8]]
NEW = 16


def _yarn(mscale, mscale_all_dim):
    return dict(rope_type="yarn", rope_theta=10000.0, factor=4.0, original_max_position_embeddings=64,
                beta_fast=32, beta_slow=1, mscale=mscale, mscale_all_dim=mscale_all_dim)


# 4 layers, the first dense; 8 routed experts in 4 groups, top-2 of the 2 best groups, 2 shared
# experts, q low-rank (conftest), YaRN whose mscale differs from mscale_all_dim (so both the
# cos/sin factor and the softmax scale move)
V3 = dict(num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=8, n_group=4, topk_group=2,
          num_experts_per_tok=2, n_shared_experts=2, routed_scaling_factor=2.5, rope_parameters=_yarn(1.0, 0.8))
# V2-Lite's shape: no q low-rank, softmax greedy top-k, 2 shared experts, YaRN as V2-Lite's
V2 = dict(num_hidden_layers=4, first_k_dense_replace=1, n_routed_experts=8, num_experts_per_tok=2,
          rope_parameters=_yarn(0.707, 0.707))


def _dress(model_dir, hidden):
    """A non-zero routing correction bias in every MoE layer (V3), and the tensors of a
    multi-token-prediction layer after the last one, as the official checkpoint has (layer 4
    here; they do not fit any layer, so reading one would fail)."""
    from safetensors.torch import load_file, save_file

    path = str(model_dir / "model.safetensors")
    tensors = load_file(path)
    for name in list(tensors):
        if name.endswith("mlp.gate.e_score_correction_bias"):
            tensors[name] = torch.linspace(-0.05, 0.05, len(tensors[name]))
    g = torch.Generator().manual_seed(1)
    tensors["model.layers.4.eh_proj.weight"] = torch.randn(hidden, 2 * hidden, generator=g)
    tensors["model.layers.4.enorm.weight"] = torch.ones(hidden)
    tensors["model.layers.4.self_attn.kv_a_proj_with_mqa.weight"] = torch.randn(3, 5, generator=g)
    tensors["model.layers.4.mlp.experts.0.gate_proj.weight"] = torch.randn(3, 5, generator=g)
    save_file(tensors, path, metadata={"format": "pt"})


@pytest.fixture(scope="module")
def models(tiny_model):
    """name -> (model dir, transformers' greedy tokens), each built once."""
    built = {}

    def get(name):
        if name not in built:
            d = tiny_model("deepseek_v3", **V3) if name == "v3" else tiny_model("deepseek_v2", **V2)
            _dress(d, 64)
            built[name] = (d, reference_tokens(d, PROMPTS, NEW))
        return built[name]

    return get


@pytest.mark.timeout(300)
# TP4EP2: moe_tp 2 (each expert split over 2 ranks); EP2PP2: EP inside each pipeline stage;
# DP2, DP2PP2: attention data parallel, the experts pure TP over the DP ranks
@pytest.mark.parametrize("name,layout", [("v3", "TP1"), ("v3", "TP2"), ("v3", "PP2"),
                                         pytest.param("v3", "EP4", marks=pytest.mark.slow), ("v3", "DP2EP2"),
                                         pytest.param("v3", "TP2PP2", marks=pytest.mark.slow), ("v3", "TP4EP2"),
                                         ("v3", "EP2PP2"),
                                         ("v3", "DP2"), ("v3", "DP2PP2"), ("v2", "TP2"), ("v2", "EP2")])
def test_greedy_tokens_match_transformers(models, name, layout):
    model_dir, expected = models(name)
    outs = LLM(model_dir, layout=layout).generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected


def _step(model, cache, rows: list[tuple[list[int], int, list[int]]]):
    """One step of several sequences: (block table, tokens in the cache, new tokens) each."""
    meta = AttentionMetadata.build([t for t, _, _ in rows], [s for _, s, _ in rows], [len(n) for _, _, n in rows], 4)
    return model(torch.tensor([x for _, _, n in rows for x in n]), meta, cache)


@pytest.mark.parametrize("name", ["v3", "v2"])
def test_logits_match_transformers_through_prefill_chunks_and_decode(models, name):
    """In one process: a prompt prefilled in two chunks (the second attends to the cached
    first), then decode steps of two sequences (the absorbed path), logits to fp32 tolerance."""
    from transformers import AutoModelForCausalLM

    model_dir, _ = models(name)
    cfg = ModelConfig.load(model_dir)
    model = build_model(cfg, ParallelContext.single()).eval()
    load_weights(model, Checkpoint(model_dir))
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    cache = make_cache(cfg, 1, layers=cfg.num_hidden_layers, blocks=12, block_size=4, dtype=torch.float32,
                       device="cpu")
    a, b = list(PROMPTS[2]), list(PROMPTS[0])
    ta, tb = [0, 1, 2, 3, 4], [5, 6, 7, 8, 9]  # 4-token blocks: contexts cross block edges
    with torch.no_grad():
        _step(model, cache, [(ta, 0, a[:5])])
        got = _step(model, cache, [(ta, 5, a[5:]), (tb, 0, b)])  # a's second chunk beside b's prompt
        for _ in range(3):
            want = torch.stack([ref(torch.tensor([s])).logits[0, -1] for s in (a, b)])
            torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
            na, nb = (int(t) for t in want.argmax(-1))
            got = _step(model, cache, [(ta, len(a), [na]), (tb, len(b), [nb])])
            a, b = a + [na], b + [nb]


def test_multi_token_prediction_layer_is_never_read(models):
    model_dir, _ = models("v3")
    cfg = ModelConfig.load(model_dir)
    model = build_model(cfg, ParallelContext.single())
    ckpt = Checkpoint(model_dir)
    load_weights(model, ckpt)
    mtp = {n for n in ckpt.names() if n.startswith("model.layers.4.")}
    assert len(mtp) == 4 and all(model.checkpoint_targets(n) == [] for n in mtp)
    assert set(ckpt.tensors_read) == set(ckpt.names()) - mtp  # everything else read


@pytest.mark.parametrize("layout", ["TP8PP2", "EP16", "DP16EP16", "TP16"])
def test_latent_cache_bytes_per_token_match_the_planner(layout):
    """DeepSeek-V3: per token, the cache object holds layers x 576 values on every rank (TP
    does not split the latent); the planner's memory model counts the same bytes."""
    from atoll.planner import Workload
    from atoll.planner.memory import memory_fit
    from atoll.planner.shapes import shapes
    from atoll.topologies import load_topology

    _, cfg = resolve_model("DeepSeek-V3")
    lay, s = Layout.parse(layout), shapes(cfg)
    per_stage = []
    for start, end in stage_layers(cfg, lay.pp):
        cache = make_cache(cfg, lay.tp, layers=end - start, blocks=3, block_size=16, dtype=torch.bfloat16,
                           device="meta")
        assert cache.k[0].shape == (3, 16, 1, 576) and cache.v == [None] * (end - start)  # no separate V
        assert cache.bytes_per_token == (end - start) * 576 * 2
        assert cache.bytes_per_token == (end - start) * s.kv_bytes_per_token_layer(lay.tp, 2)
        per_stage.append(cache.bytes_per_token)
    # block sizing (--kv-cache-gb, --gpu-memory-utilization) takes the largest stage's
    assert kv_bytes_per_block(cfg, lay, 2, 16) == 16 * max(per_stage)
    w = Workload(isl=1024, osl=256, concurrency=64, dtype="fp8").resolved(cfg)
    assert w.kv_bytes == 2
    fit = memory_fit(cfg, s, load_topology("dgx-h200", nodes=2), w, lay, batch=64)
    per_dp = -(-64 // lay.dp)
    assert fit.kv_cache in {per_dp * w.context * b for b in per_stage}


def _config_dir_as_transformers_writes_it(tmp_path):
    """The DeepSeek-V3 preset's numbers through transformers' DeepseekV3Config.save_pretrained
    (rope_parameters, not rope_scaling; every default spelled out)."""
    from transformers import DeepseekV3Config

    p = dict(PRESETS["DeepSeek-V3"])
    for k in ("model_type", "architectures", "torch_dtype", "quantization_config", "rope_scaling", "rope_theta",
              "moe_layer_freq", "scoring_func", "topk_method"):
        p.pop(k)
    rope = dict(PRESETS["DeepSeek-V3"]["rope_scaling"])
    rope["rope_type"] = rope.pop("type")
    DeepseekV3Config(**p, rope_parameters={**rope, "rope_theta": 10000.0}).save_pretrained(tmp_path)
    assert "rope_parameters" in json.loads((tmp_path / "config.json").read_text())
    return tmp_path


def test_plan_preset_and_config_directory_give_the_same_shapes(tmp_path, capsys):
    from atoll.cli.main import main
    from atoll.layers.mla import softmax_scale
    from atoll.layers.rotary import rope_frequencies
    from atoll.planner.shapes import shapes

    d = _config_dir_as_transformers_writes_it(tmp_path)
    _, preset = resolve_model("DeepSeek-V3")
    _, local = resolve_model(str(d))
    assert shapes(local) == shapes(preset)
    assert softmax_scale(local) == softmax_scale(preset)
    for a, b in zip(rope_frequencies(64, preset.rope_theta, preset.rope_scaling, preset.max_position_embeddings),
                    rope_frequencies(64, local.rope_theta, local.rope_scaling, local.max_position_embeddings)):
        assert torch.equal(torch.as_tensor(a), torch.as_tensor(b))
    outs = []
    for model in ("DeepSeek-V3", str(d)):
        with pytest.raises(SystemExit) as e:
            main(["plan", "--model", model, "--topology", "dgx-h200", "--nodes", "2", "--dtype", "fp8",
                  "--concurrency", "1,1024", "--layouts", "TP8PP2,EP16,DP16EP16", "--format", "json"])
        assert e.value.code == 0
        sweep = json.loads(capsys.readouterr().out)  # one plan per concurrency
        outs.append([{k: v for k, v in p.items() if k != "model"} for p in sweep])
    assert outs[0] == outs[1] and len(outs[0]) == 2


def test_v2_group_limited_router_matches_transformers():
    """DeepSeek-V2's group_limited_greedy (groups by their best expert, the rest zeroed) and
    its routed scaling, on the softmax router."""
    from transformers import DeepseekV2Config
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

    from atoll.models.moe import make_router

    hf = DeepseekV2Config(hidden_size=32, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=3,
                          n_group=4, topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=1.5)
    ref = DeepseekV2TopkRouter(hf)
    torch.nn.init.normal_(ref.weight, generator=torch.Generator().manual_seed(0))
    cfg = ModelConfig.from_dict({**hf.to_dict(), "model_type": "deepseek_v2"})
    assert (cfg.scoring, cfg.n_group, cfg.topk_group, cfg.norm_topk_prob) == ("softmax", 4, 2, False)
    router = make_router(cfg, torch.float32)
    router.weight.data.copy_(ref.weight.data)
    x = torch.randn(20, 32, generator=torch.Generator().manual_seed(1))
    ids, weights = router(x)
    _, want_w, want_ids = ref(x)
    order, want_order = ids.argsort(-1), want_ids.argsort(-1)
    assert torch.equal(ids.gather(1, order), want_ids.gather(1, want_order))
    torch.testing.assert_close(weights.gather(1, order), want_w.gather(1, want_order))
