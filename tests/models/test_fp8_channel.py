"""fp8 checkpoints with a scale per tensor or per output channel (vLLM's fp8 layout, and the
same tensors under compressed-tensors): each `*_proj.weight` of a tiny transformers Llama
quantized here to float8 e4m3 beside its `weight_scale` (and, static, `input_scale`), loaded
by atoll with --quantization fp8 at TP1 and TP2 and compared with transformers running the
dequantized weights (q.float() * scale, written beside the fp8 checkpoint).

On the CPU the fp8 products multiply the activations as they are by the weight dequantized
for the call, exactly those weights, so the logits agree to float32 rounding and the greedy
tokens exactly; the static input scale is kept (the merged [q; k; v] and [gate; up] take
their parts' largest) for the Triton path, which quantizes activations by it."""

import json
import math
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from quant_fns import weight_report
from reference import reference_tokens
from test_kernels import triton_path  # noqa: F401  (fixture)

from atoll import LLM, SamplingParams
from atoll.errors import CheckpointError
from atoll.kernels import fp8 as kfp8
from atoll.models import ModelConfig, build_model
from atoll.models.checkpoint import Checkpoint, load_weights
from atoll.models.fp8 import ChannelFp8Source
from atoll.models.fp8_scheme import scheme
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext

E4M3_MAX = 448.0
PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8], [250]]
NEW = 16


def quantize(w: torch.Tensor, per_channel: bool, scale_shape) -> tuple[torch.Tensor, torch.Tensor]:
    amax = w.abs().amax(dim=1, keepdim=True) if per_channel else w.abs().amax()
    scale = (amax / E4M3_MAX).clamp(min=1e-12).float()
    q = (w / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return q, scale.reshape(scale_shape(w.shape[0]))


def write_pair(src: Path, root: Path, *, per_channel: bool, static: bool, compressed: bool = False):
    """src (a float32 checkpoint) -> (fp8 dir, dequantized reference dir, {input scale name: value})."""
    fp8_dir, ref_dir = root / "fp8", root / "ref"
    for d in (fp8_dir, ref_dir):
        d.mkdir(parents=True)
        for f in src.iterdir():
            if f.suffix != ".safetensors":
                shutil.copy(f, d / f.name)
    if per_channel:  # vLLM writes [out] or [out, 1]; compressed-tensors [out, 1]
        shape = (lambda n: (n, 1)) if compressed else (lambda n: (n,))
    else:
        shape = (lambda n: (1,)) if compressed else (lambda n: ())
    fp8_t, ref_t, inputs = {}, {}, {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if t.dim() == 2 and name.endswith("_proj.weight"):
            q, s = quantize(t, per_channel, shape)
            fp8_t[name], fp8_t[name + "_scale"] = q, s
            ref_t[name] = q.float() * s.reshape(-1, 1)
            if static:  # distinct values, so a merged module's choice shows
                inp = name.removesuffix("weight") + "input_scale"
                inputs[inp] = 0.01 * (1 + len(inputs) % 7)
                fp8_t[inp] = torch.tensor(inputs[inp], dtype=torch.float32).reshape((1,) if compressed else ())
        else:
            fp8_t[name] = ref_t[name] = t.contiguous()
    save_file(fp8_t, str(fp8_dir / "model.safetensors"), metadata={"format": "pt"})
    save_file(ref_t, str(ref_dir / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    if compressed:
        act = {"num_bits": 8, "type": "float", "strategy": "tensor", "dynamic": False, "symmetric": True} if static \
            else {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True, "symmetric": True}
        weights = {"num_bits": 8, "type": "float", "strategy": "channel" if per_channel else "tensor",
                   "dynamic": False, "symmetric": True}
        config["quantization_config"] = {"quant_method": "compressed-tensors", "format": "float-quantized",
                                         "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                                                       "input_activations": act}},
                                         "ignore": ["lm_head"], "kv_cache_scheme": None}
    else:
        config["quantization_config"] = {"quant_method": "fp8",
                                         "activation_scheme": "static" if static else "dynamic"}
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))
    return fp8_dir, ref_dir, inputs


VARIANTS = {  # name -> (per_channel, static, compressed)
    "tensor-static": (False, True, False),
    "channel-dynamic": (True, False, False),
    "ct-channel-static": (True, True, True),
    "ct-tensor-dynamic": (False, False, True),
}


@pytest.fixture(scope="module")
def pairs(tiny_model, tmp_path_factory):
    out = {}

    def get(variant):
        if variant not in out:
            per_channel, static, compressed = VARIANTS[variant]
            out[variant] = write_pair(tiny_model("llama"), tmp_path_factory.mktemp(f"fp8-{variant}"),
                                      per_channel=per_channel, static=static, compressed=compressed)
        return out[variant]

    return get


def test_a_slice_reads_its_rows_scales(tmp_path):
    w = torch.randn(300, 200) * torch.logspace(-2, 1, 300)[:, None]
    for per_channel, shape in ((True, (300, 1)), (True, (300,)), (False, ()), (False, (1,))):
        q, s = quantize(w, per_channel, lambda n: shape)
        save_file({"w": q, "w_scale": s, "i": torch.tensor([0.5])}, str(tmp_path / "model.safetensors"))
        ckpt = Checkpoint(tmp_path)
        src = ChannelFp8Source("w", ckpt.get("w"), ckpt.get("w_scale"), ckpt.get("i"), scale_name="w_scale",
                               input_name="i")
        full = q.float() * s.reshape(-1, 1)
        assert torch.equal(src[:], full)
        for rows, cols in ((slice(96, 192), slice(None)), (slice(None), slice(100, 200)), (slice(5, 9), slice(1, 130))):
            assert torch.equal(src[rows, cols], full[rows, cols])
            raw = src.raw()[rows, cols]  # as stored, each row's scale over its 128-column groups
            assert raw.dtype == torch.float8_e4m3fn and float(raw.fp8_input_scale) == 0.5
            assert torch.equal(kfp8.dequantize_weight(raw, raw.fp8_scale), full[rows, cols])


def test_schemes_and_refusals():
    assert scheme({"quantization_config": {"quant_method": "fp8", "activation_scheme": "static"}}).static_inputs
    s = scheme({"quantization_config": {"quant_method": "fp8"}})
    assert s.block is None and not s.static_inputs and s.weight_of("a.input_scale") == "a.weight"
    assert s.weight_of("a.weight_scale") == "a.weight" and s.weight_of("a.weight") is None
    assert scheme({"quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]}}).block == (128, 128)
    int4 = {"quant_method": "compressed-tensors", "format": "pack-quantized", "config_groups": {}}
    with pytest.raises(CheckpointError, match="format='pack-quantized' is not supported"):
        scheme({"quantization_config": int4})
    blocks = {"quant_method": "compressed-tensors", "format": "float-quantized", "config_groups": {
        "g": {"weights": {"num_bits": 8, "type": "float", "strategy": "block"}}}}
    with pytest.raises(CheckpointError, match="group g: weights .*strategy='block'.* are not supported"):
        scheme({"quantization_config": blocks})
    with pytest.raises(CheckpointError, match="activation_scheme='per_token' must be dynamic or static"):
        scheme({"quantization_config": {"quant_method": "fp8", "activation_scheme": "per_token"}})


def test_a_malformed_scale_is_one_line_naming_it(pairs, tmp_path):
    fp8_dir, _, _ = pairs("channel-dynamic")
    bad = tmp_path / "bad"
    shutil.copytree(fp8_dir, bad)
    tensors = load_file(str(bad / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight_scale"
    tensors[name] = tensors[name][:-1]  # one row short
    save_file(tensors, str(bad / "model.safetensors"), metadata={"format": "pt"})
    model = build_model(ModelConfig.load(bad), ParallelContext.detached(Layout.parse("TP1"), 0, device="cpu"),
                        dtype=torch.float32)
    with pytest.raises(CheckpointError) as e:
        load_weights(model, Checkpoint(bad))
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"tensor {name} has shape (63,);"), msg
    assert "needs one scale ([] or [1]) or one per output row ([64] or [64, 1])" in msg


def test_static_input_scale_on_the_triton_path(triton_path):
    g = torch.Generator().manual_seed(3)
    x, w = torch.randn(7, 256, generator=g), torch.randn(96, 256, generator=g) * 0.1
    wq, ws = kfp8.quantize_weight(w)
    input_scale = x.abs().amax() / E4M3_MAX * 1.5
    a, a_s = kfp8.quantize_static(x, input_scale)
    assert torch.equal(a_s, torch.full((7, 2), float(input_scale)))
    got = kfp8.fp8_linear(x, wq, ws, input_scale=input_scale)
    want = kfp8.gemm_reference(a, a_s, wq, ws, torch.float32)
    assert (got - want).abs().max() <= 1e-5 * want.abs().max()
    exact = x @ w.T
    assert (got - exact).abs().max() <= 0.15 * exact.abs().max()


def _bf16_param_bytes(model_dir, layout: str, rank: int) -> dict:
    model = build_model(ModelConfig.load(model_dir), ParallelContext.detached(Layout.parse(layout), rank),
                        dtype=torch.bfloat16, device="meta")
    return {n: p.numel() * p.element_size() for n, p in model.named_parameters()}


@pytest.mark.timeout(400)
@pytest.mark.parametrize("variant,layout", [("tensor-static", "TP1"), ("tensor-static", "TP2"),
                                            ("channel-dynamic", "TP2"), ("ct-channel-static", "TP2"),
                                            ("ct-tensor-dynamic", "TP1")])
def test_fp8_checkpoint_kept_in_fp8_matches_the_dequantized_model(pairs, variant, layout):
    from transformers import AutoModelForCausalLM

    from atoll.engine.driver.perplexity import run_scores, windows

    fp8_dir, ref_dir, inputs = pairs(variant)
    ids = torch.randint(0, 301, (64,), generator=torch.Generator().manual_seed(1)).tolist()
    wins = windows(ids, 32, 64)
    with LLM(fp8_dir, layout=layout, quantization="fp8", max_num_seqs=4) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
        scores = run_scores(llm, wins)
        reports = llm.run(weight_report, llm.layout.world_size, llm.spec(), parallel=llm.context_options())
    assert [o.token_ids for o in outs] == reference_tokens(ref_dir, PROMPTS, NEW)
    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32)
    with torch.no_grad():
        logits = ref(torch.tensor(wins)).logits.double()
    nll = -torch.log_softmax(logits[:, :-1], -1).gather(2, torch.tensor(wins)[:, 1:, None])
    assert scores.perplexity == pytest.approx(math.exp(nll.mean().item()), rel=1e-4)
    assert scores.top1 == logits[:, :-1].argmax(-1).tolist()
    from test_int8_weights import planner_weight_bytes

    assert planner_weight_bytes(fp8_dir, layout, "fp8") == max(r["bytes"] for r in reports)  # the same rule
    for r in reports:
        names = r["fp8_names"]  # qkv, o, gate_up, down of 3 layers: row-parallel shards too
        assert len(names) == 12 and sum("o_proj" in n or "down_proj" in n for n in names) == 6, names
        bf16 = _bf16_param_bytes(fp8_dir, layout, r["rank"])
        assert r["fp8_bytes"] == r["fp8_elements"] and sum(bf16[n] for n in names) == 2 * r["fp8_bytes"]
        # plus the scales: 4 bytes per row and 128 columns (64 columns here: 1/16 of the fp8 bytes)
        assert r["fp8_bytes"] + r["scale_bytes"] <= 0.55 * sum(bf16[n] for n in names)
        got = r["input_scales"]
        if not inputs:
            assert got == {}
            continue
        assert len(got) == 12
        for layer in range(3):
            pre = f"model.layers.{layer}."
            qkv = max(inputs[pre + f"self_attn.{p}_proj.input_scale"] for p in "qkv")
            assert got[pre + "self_attn.qkv_proj.input_scale"] == pytest.approx(qkv)
            assert got[pre + "mlp.down_proj.input_scale"] == pytest.approx(inputs[pre + "mlp.down_proj.input_scale"])


@pytest.mark.timeout(200)
def test_without_quantization_the_checkpoint_loads_dequantized(pairs):
    fp8_dir, ref_dir, _ = pairs("channel-dynamic")
    with LLM(fp8_dir, layout="TP2") as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == reference_tokens(ref_dir, PROMPTS, NEW)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["TP2", "EP2"])
def test_moe_experts_with_per_channel_scales_stay_fp8(tiny_model, tmp_path, layout):
    """qwen3_moe's experts (intermediate 32: 16-column down-projection shards under TP2, whose
    block rule would keep them float) stay fp8 with a scale per row."""
    fp8_dir, ref_dir, _ = write_pair(tiny_model("qwen3_moe"), tmp_path, per_channel=True, static=True)
    with LLM(fp8_dir, layout=layout, quantization="fp8", max_num_seqs=4) as llm:
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
        reports = llm.run(weight_report, llm.layout.world_size, llm.spec(), parallel=llm.context_options())
    assert [o.token_ids for o in outs] == reference_tokens(ref_dir, PROMPTS, NEW)
    for r in reports:
        names = r["fp8_names"]
        assert sum("experts.w13" in n or "experts.w2" in n for n in names) == 2 * 3, names
        assert not any("mlp.gate." in n or "embed" in n or "lm_head" in n for n in names), names
