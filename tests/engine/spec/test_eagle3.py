"""EAGLE-3 drafting (models/eagle3.py, engine/spec/eagle3.py) on a tiny Llama with a random head
written in the published layout (fc, midlayer.*, norm, lm_head over a draft vocabulary, d2t,
t2d): the engine's drafts against a reference written from the format's description in plain
torch over transformers' hidden states, greedy tokens identical to transformers at TP1 and TP2
(both acceptances and rejections seen) and under the compiled CPU step, a malformed head
refused in one line naming the tensor, and a few training steps writing a head that loads."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from reference import reference_tokens

from atoll import LLM, SamplingParams
from atoll.engine.rank.loop import run_batch
from atoll.engine.rank.runner import ModelRunner
from atoll.engine.rank import runner as runner_module
from atoll.engine.sample.tree import path_slots
from atoll.engine.spec import eagle3 as eagle3_drafter
from atoll.errors import InputError
from atoll.models.config import ModelConfig
from atoll.models.eagle3 import aux_layers, head_config, save_head
from atoll.models.eagle3_train import train_head
from atoll.parallel.mesh import ParallelContext

LAYERS = 4
AUX = [0, 2, 3]  # eagle_config's ids: layer 0's input (the embeddings) included
DRAFT_VOCAB = 200
PROMPTS = [[5, 7, 9, 11, 13] * 3, [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8] * 2, [250]]
NEW = 24
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)
EPS = 1e-6


def random_head(target_dir, out, expected, seed: int = 3):
    """A random head for the target in the published layout. fc leans on the last fused state
    and lm_head on the target's own: its drafts are the target's logit lens at layer 3, which
    a repeating continuation takes at times (acceptances) and otherwise not (rejections)."""
    config = ModelConfig.load(target_dir)
    base = load_file(str(target_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    h, hd, inter = config.hidden_size, config.head_dim, config.intermediate_size
    q, kv = config.num_attention_heads * hd, config.num_key_value_heads * hd
    used = sorted({t for row in expected for t in row})
    rest = [t for t in torch.randperm(config.vocab_size, generator=g).tolist() if t not in used]
    ids = torch.tensor(sorted(used + rest[:DRAFT_VOCAB - len(used)]))

    def rand(*shape, scale=0.1):
        return scale * torch.randn(*shape, generator=g)

    def near_one(n):
        return 1.0 + rand(n)

    fc = rand(h, 3 * h, scale=0.01)
    fc[:, 2 * h:] += torch.eye(h)
    m = "midlayer."
    tensors = {"fc.weight": fc, m + "input_layernorm.weight": near_one(h), m + "hidden_norm.weight": near_one(h),
               m + "self_attn.q_proj.weight": rand(q, 2 * h), m + "self_attn.k_proj.weight": rand(kv, 2 * h),
               m + "self_attn.v_proj.weight": rand(kv, 2 * h), m + "self_attn.o_proj.weight": rand(h, q, scale=0.02),
               m + "post_attention_layernorm.weight": near_one(h), m + "mlp.gate_proj.weight": rand(inter, h),
               m + "mlp.up_proj.weight": rand(inter, h), m + "mlp.down_proj.weight": rand(h, inter, scale=0.02),
               "norm.weight": base["model.norm.weight"].clone(),
               "lm_head.weight": base["lm_head.weight"][ids] + rand(DRAFT_VOCAB, h, scale=0.01),
               "d2t": ids - torch.arange(DRAFT_VOCAB),
               "t2d": torch.zeros(config.vocab_size, dtype=torch.bool).index_fill_(0, ids, True)}
    save_head(out, tensors, head_config(config, draft_vocab_size=DRAFT_VOCAB, aux=AUX))
    return out


@pytest.fixture(scope="module")
def target(tiny_model):
    d = tiny_model("llama", num_hidden_layers=LAYERS)
    return d, reference_tokens(d, PROMPTS, NEW)


@pytest.fixture(scope="module")
def head(target, tmp_path_factory):
    return random_head(target[0], tmp_path_factory.mktemp("eagle3-head"), target[1])


def _rms(x, w):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS) * w


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class Reference:
    """The head per the published format over transformers' hidden states (hidden_states[i] is
    layer i's input), whole sequences at once with a causal mask."""

    def __init__(self, target_dir, head_dir):
        from transformers import AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
        self.t = load_file(str(head_dir / "model.safetensors"))
        self.cfg = json.loads((head_dir / "config.json").read_text())

    @torch.no_grad()
    def fused(self, tokens):
        hs = self.target(torch.tensor([tokens]), output_hidden_states=True).hidden_states
        return torch.cat([hs[i][0] for i in AUX], dim=-1) @ self.t["fc.weight"].T

    @torch.no_grad()
    def head(self, g, next_tokens):
        t, c, m = self.t, self.cfg, "midlayer."
        n, heads, kvh, d = len(g), c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]
        emb = self.target.model.embed_tokens.weight[torch.tensor(next_tokens)]
        x = torch.cat([_rms(emb, t[m + "input_layernorm.weight"]), _rms(g, t[m + "hidden_norm.weight"])], dim=-1)
        q = (x @ t[m + "self_attn.q_proj.weight"].T).view(n, heads, d).transpose(0, 1)
        k = (x @ t[m + "self_attn.k_proj.weight"].T).view(n, kvh, d).transpose(0, 1)
        v = (x @ t[m + "self_attn.v_proj.weight"].T).view(n, kvh, d).transpose(0, 1)
        inv = 1.0 / (c["rope_theta"] ** (torch.arange(0, d, 2).float() / d))
        ang = torch.arange(n).float()[:, None] * inv[None]
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k, v = k.repeat_interleave(heads // kvh, 0), v.repeat_interleave(heads // kvh, 0)
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(0, 1).reshape(n, heads * d)
        residual = g + att @ t[m + "self_attn.o_proj.weight"].T
        h = _rms(residual, t[m + "post_attention_layernorm.weight"])
        mlp = (F.silu(h @ t[m + "mlp.gate_proj.weight"].T) * (h @ t[m + "mlp.up_proj.weight"].T)) \
            @ t[m + "mlp.down_proj.weight"].T
        return residual + mlp

    def token(self, out):
        draft = int((_rms(out, self.t["norm.weight"]) @ self.t["lm_head.weight"].T).argmax())
        return draft + int(self.t["d2t"][draft])

    def drafts(self, tokens, k):
        """The K drafts after `tokens` (the last one pending): the head over (g_i, t_{i+1}), then
        recurrently on its own output and its own draft."""
        g, ids, out = self.fused(tokens[:-1]), list(tokens[1:]), []
        for _ in range(k):
            o = self.head(g, ids)
            out.append(self.token(o[-1]))
            g, ids = torch.cat([g, o[-1:]]), ids + [out[-1]]
        return out


def _counts(outs):
    m = [o.metrics for o in outs]
    return sum(x["spec_drafted"] for x in m), sum(x["spec_accepted"] for x in m)


def test_engine_drafts_match_the_reference(target, head, monkeypatch):
    """Every draft the engine made with K=3 is the reference's for the same tokens."""
    model_dir, expected = target
    seen = []
    propose = eagle3_drafter.Eagle3Drafter.propose

    def recording(self, wants):
        drafts = propose(self, wants)
        seen.extend((list(seq.tokens), k, d) for (seq, k), d in zip(wants, drafts))
        return drafts

    monkeypatch.setattr(eagle3_drafter.Eagle3Drafter, "propose", recording)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    llm = LLM(model_dir, block_size=4, speculative_config=spec)
    requests = llm.prepare(PROMPTS[:2], GREEDY)
    runner = ModelRunner(llm.spec(requests), ParallelContext.single())  # in this process: the recording seen
    assert [r["token_ids"] for r in run_batch(runner, requests)] == expected[:2]
    drafted = [(tokens, k, d) for tokens, k, d in seen if d]
    assert len(drafted) >= 10 and any(len(d) == 3 for _, _, d in drafted)
    ref = Reference(model_dir, head)
    for tokens, k, d in drafted:
        assert d == ref.drafts(tokens, k)[:len(d)], tokens


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["TP1", "TP2"])
@pytest.mark.parametrize("k", [1, 3])
def test_greedy_matches_transformers(target, head, layout, k):
    model_dir, expected = target
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}
    outs = LLM(model_dir, layout=layout, block_size=4, speculative_config=spec).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    drafted, accepted = _counts(outs)
    assert 0 < accepted < drafted  # both acceptances and rejections happened


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["TP1", "TP2"])
def test_tree_greedy_matches_transformers(target, head, layout):
    """Tree drafts (topk 2, 3 deep: 6 nodes a step) verified in one forward with the tree mask."""
    model_dir, expected = target
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "topk": 2}
    outs = LLM(model_dir, layout=layout, block_size=4, speculative_config=spec).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    drafted, accepted = _counts(outs)
    assert 0 < accepted < drafted


def test_tree_sampling_is_seeded(target, head):
    """Sampled tree steps (SpecInfer's rule, engine.sample.tree_rule) draw from each request's
    own seeded stream: two runs give the same tokens, and drafts are both kept and rejected."""
    model_dir, _ = target
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "topk": 2}
    params = SamplingParams(max_tokens=NEW, temperature=0.8, seed=7, ignore_eos=True)
    runs = [LLM(model_dir, block_size=4, speculative_config=spec).generate(PROMPTS, params) for _ in range(2)]
    assert [o.token_ids for o in runs[0]] == [o.token_ids for o in runs[1]]
    assert all(len(o.token_ids) == NEW for o in runs[0])
    drafted, accepted = _counts(runs[0])
    assert 0 < accepted < drafted


def test_tree_paths_off_the_first_branch_are_compacted(target, head, monkeypatch):
    """In process: some kept paths leave the first child's line (their keys move: path_slots),
    and the tokens still equal transformers'."""
    model_dir, expected = target
    moved = []
    compact = runner_module.compact

    def recording(cache, table, start, path, block_size):
        moved.extend(path_slots(start, path))
        compact(cache, table, start, path, block_size)

    monkeypatch.setattr(runner_module, "compact", recording)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3, "topk": 2}
    llm = LLM(model_dir, block_size=4, speculative_config=spec)
    requests = llm.prepare(PROMPTS, GREEDY)
    runner = ModelRunner(llm.spec(requests), ParallelContext.single())
    assert [r["token_ids"] for r in run_batch(runner, requests)] == expected
    assert moved
    assert runner.stats["blocks_held"] == 0


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_greedy_matches_under_the_compiled_step(target, head):
    """The compiled CPU decode step runs the verify rows; its layers' hooks still feed the head."""
    model_dir, expected = target
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
    llm = LLM(model_dir, block_size=4, max_num_seqs=4, compile="always", enforce_eager=False, speculative_config=spec)
    outs = llm.generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    drafted, accepted = _counts(outs)
    assert 0 < accepted < drafted


def test_malformed_head_refused_in_one_line(target, head, tmp_path):
    """A missing tensor, a tensor of the wrong shape and a config off the target's size are each
    refused before any rank starts, in one line naming the tensor or field."""
    model_dir, _ = target
    tensors = load_file(str(head / "model.safetensors"))
    cases = {"lacks tensor midlayer.self_attn.q_proj.weight": dict(tensors) | {"midlayer.self_attn.q_proj.weight": None},
             "tensor fc.weight has shape": dict(tensors) | {"fc.weight": tensors["fc.weight"][:, :10].clone()},
             "lacks tensor d2t": dict(tensors) | {"d2t": None}}
    for i, (message, case) in enumerate(cases.items()):
        d = tmp_path / f"bad{i}"
        shutil.copytree(head, d)
        save_file({n: t for n, t in case.items() if t is not None}, str(d / "model.safetensors"))
        with pytest.raises(InputError, match=message) as e:
            LLM(model_dir, speculative_config={"method": "eagle3", "model": str(d)})
        assert "\n" not in str(e.value)
    d = tmp_path / "wide"
    shutil.copytree(head, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"hidden_size": 128}))
    with pytest.raises(InputError, match="hidden_size 128 is not the target's 64"):
        LLM(model_dir, speculative_config={"method": "eagle3", "model": str(d)})
    with pytest.raises(InputError, match="goes with method draft_model or eagle3"):
        LLM(model_dir, speculative_config={"method": "eagle3"})


def test_aux_layers_default_and_config():
    assert aux_layers({}, 32) == [2, 16, 29]  # vLLM's default for a 32-layer target
    assert aux_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 5, 9]}}, 32) == [1, 5, 9]
    with pytest.raises(InputError, match="eagle_aux_hidden_state_layer_ids"):
        aux_layers({"eagle_config": {"eagle_aux_hidden_state_layer_ids": [1, 40, 2]}}, 32)


def test_training_writes_a_head_that_loads(target, tmp_path):
    """A few training steps on the target's own continuations: the loss falls, the head is
    written in the published layout (d2t over the most frequent target tokens) and drafts
    through the engine with the target's tokens unchanged."""

    model_dir, expected = target
    sequences = [(p + e, len(p)) for p, e in zip(PROMPTS, expected)]
    out = tmp_path / "trained"
    summary = train_head(model_dir, sequences, out, steps=24, seconds=60, ttt=3, vocab_size=64, lr=3e-3,
                         progress=False)
    losses = summary["losses"]
    assert summary["steps"] == 24 and summary["aux_layers"] == [2, 2, 1]  # vLLM's default for 4 layers
    assert sum(losses[-6:]) / 6 < 0.7 * sum(losses[:6]) / 6
    t = load_file(str(out / "model.safetensors"))
    ids = torch.arange(64) + t["d2t"]
    assert t["t2d"].sum() == 64 and bool(t["t2d"][ids].all())
    assert {x for row in expected for x in row} <= set(ids.tolist())  # every continuation token is in it
    assert "embed_tokens.weight" not in t and t["lm_head.weight"].shape == (64, 64)
    spec = {"method": "eagle3", "model": str(out), "num_speculative_tokens": 3}
    outs = LLM(model_dir, block_size=4, speculative_config=spec).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    drafted, accepted = _counts(outs)
    assert drafted > 0 and accepted > 0
