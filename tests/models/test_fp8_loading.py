"""fp8 block-quantized checkpoints (DeepSeek-V3's layout) load as their dequantized weights:
each rank reads its slice of the fp8 weight and of the block scales, also where the slice
starts inside a 128 x 128 block (hidden 192, intermediate 320: every TP shard and moe_tp
expert slice below starts mid-block)."""

import pytest
import torch
from fp8_quant import BLOCK, dequantize, quantize, write_fp8_pair
from safetensors import safe_open
from safetensors.torch import save_file

from atoll.engine.rank.run_spec import RunSpec
from atoll.engine.rank.runner import ModelRunner
from atoll.launch.local import run_local
from atoll.layers.attention import AttentionMetadata
from atoll.models import ModelConfig, build_model
from atoll.models.checkpoint import Checkpoint, load_weights
from atoll.models.fp8 import Fp8Source
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext

SHAPES = dict(hidden_size=192, intermediate_size=320, head_dim=48)
FAMILIES = {"llama": ("llama", SHAPES),
            "qwen3_moe": ("qwen3_moe", dict(SHAPES, moe_intermediate_size=320)),
            # MLA projections and experts whose rows start mid-block under TP2 and EP2
            "deepseek_v3": ("deepseek_v3", dict(hidden_size=192, intermediate_size=320, moe_intermediate_size=160,
                                                num_hidden_layers=2, first_k_dense_replace=1, n_routed_experts=8,
                                                n_group=4, topk_group=2, num_experts_per_tok=2,
                                                n_shared_experts=1))}
PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8]]
STEPS = 4  # the prefill's logits, then three greedy decode steps


@pytest.fixture(scope="module")
def pairs(tiny_model, tmp_path_factory):
    """family -> (fp8 checkpoint, dequantized reference), each written once."""
    out = {}

    def get(family):
        if family not in out:
            kind, overrides = FAMILIES[family]
            root = tmp_path_factory.mktemp(f"fp8-{family}")
            out[family] = write_fp8_pair(tiny_model(kind, **overrides), root / "fp8", root / "ref")
        return out[family]

    return get


def test_a_slice_reads_its_blocks_scales(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(300, 200)
    q, s = quantize(w)
    save_file({"w": q, "w_scale_inv": s}, str(tmp_path / "model.safetensors"))
    ckpt = Checkpoint(tmp_path)
    src = Fp8Source("w", ckpt.get("w"), ckpt.get("w_scale_inv"), (BLOCK, BLOCK))
    full = dequantize(q, s)
    assert torch.equal(src[:], full)
    for rows in (slice(0, 300), slice(96, 192), slice(127, 129), slice(250, 300), slice(5, 5)):
        for cols in (slice(None), slice(100, 200), slice(1, 130)):
            assert torch.equal(src[rows, cols], full[rows, cols]), (rows, cols)
    assert torch.equal(src[160:320], full[160:]) and torch.equal(src[:, 160:], full[:, 160:])
    fresh = Checkpoint(tmp_path)
    src = Fp8Source("w", fresh.get("w"), fresh.get("w_scale_inv"), (BLOCK, BLOCK))
    assert torch.equal(src[130:250, 0:100], full[130:250, 0:100])
    assert fresh.tensors_read == {"w": 120 * 100, "w_scale_inv": 1}  # one block's scale, not all six


def _rank_params(model_dir, layout, rank):
    ctx = ParallelContext.detached(Layout.parse(layout), rank, device="cpu")
    model = build_model(ModelConfig.load(model_dir), ctx, dtype=torch.float32)
    load_weights(model, Checkpoint(model_dir))
    return dict(model.named_parameters())


@pytest.mark.parametrize("family,layout", [("llama", "TP1"), ("llama", "TP2"), ("llama", "TP4"),
                                           ("qwen3_moe", "TP2"), ("qwen3_moe", "EP2"), ("qwen3_moe", "TP4EP2")])
def test_each_rank_holds_its_dequantized_slice(pairs, family, layout):
    fp8_dir, ref_dir = pairs(family)
    with safe_open(str(fp8_dir / "model.safetensors"), "pt") as f:
        name = "model.layers.0.self_attn.q_proj.weight"
        assert f.get_tensor(name).dtype == torch.float8_e4m3fn
        assert f.get_tensor(name + "_scale_inv").shape == (2, 2)  # 192 x 192 in blocks of 128
    for rank in range(Layout.parse(layout).world_size):
        got, want = _rank_params(fp8_dir, layout, rank), _rank_params(ref_dir, layout, rank)
        assert got.keys() == want.keys()
        for p in got:
            assert torch.equal(got[p], want[p]), f"rank {rank}: {p}"


def _logits(rank, world, model_dir, layout):
    """Each step's last-token logits [STEPS, seqs, vocab] and the greedy tokens fed back."""
    spec = RunSpec.of(str(model_dir), layout, max_model_len=64, max_num_seqs=len(PROMPTS), num_blocks=16)
    ctx = ParallelContext.single() if world == 1 else ParallelContext.create(Layout.parse(layout), rank)
    runner = ModelRunner(spec, ctx)
    size = spec.engine.block_size
    tables = [list(range(i * 4, i * 4 + 4)) for i in range(len(PROMPTS))]
    prompts = [list(p) for p in PROMPTS]
    outs = []
    with torch.inference_mode():
        meta = AttentionMetadata.build(tables, [0] * len(prompts), [len(p) for p in prompts], size)
        logits = runner.model(torch.tensor(sum(prompts, [])), meta, runner.cache)
        for step in range(STEPS):
            outs.append(logits)
            if step == STEPS - 1:
                break
            nxt = logits.argmax(-1)
            meta = AttentionMetadata.build(tables, [len(p) for p in prompts], [1] * len(prompts), size)
            for p, t in zip(prompts, nxt.tolist()):
                p.append(t)
            logits = runner.model(nxt, meta, runner.cache)
    return torch.stack(outs), prompts


def _reference(ref_dir, sequences):
    """transformers' logits on the dequantized model at the same positions."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    rows = []
    with torch.no_grad():
        for p, seq in zip(PROMPTS, sequences):
            logits = ref(torch.tensor([seq])).logits[0]
            rows.append(logits[len(p) - 1:len(p) - 1 + STEPS])
    return torch.stack(rows, dim=1)  # [STEPS, seqs, vocab]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("family,layout", [("llama", "TP1"), ("llama", "TP2"), ("qwen3_moe", "TP1"),
                                           ("qwen3_moe", "TP2"), ("qwen3_moe", "EP2"),
                                           ("deepseek_v3", "TP2"), ("deepseek_v3", "EP2")])
def test_fp8_checkpoint_logits_match_the_dequantized_model(pairs, family, layout):
    fp8_dir, ref_dir = pairs(family)
    world = Layout.parse(layout).world_size
    if world == 1:
        got, sequences = _logits(0, 1, str(fp8_dir), layout)
    else:
        got, sequences = run_local(_logits, world, str(fp8_dir), layout, timeout_s=240)[0]
    want = _reference(ref_dir, sequences)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
