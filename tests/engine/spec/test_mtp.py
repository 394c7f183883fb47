"""DeepSeek-V3's multi-token-prediction drafter (models/mtp.py, engine/spec/mtp.py) on a tiny
DeepSeek-V3 whose checkpoint carries random MTP tensors for layer N = num_hidden_layers (and
num_nextn_predict_layers=1): the MTP forward against a reference written from the report's
description (plain torch around transformers' own DeepSeek-V3 decoder block), the engine's
recurrent drafts against the same reference, greedy tokens identical to transformers at TP1,
TP2 and EP2 with K=1 and K=2 (both acceptances and rejections seen), and a checkpoint without
MTP tensors refused in one line."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from mtp_fns import with_mtp_layer
from reference import reference_tokens

from atoll import LLM, SamplingParams
from atoll.engine.spec import mtp as mtp_drafter
from atoll.engine.rank.loop import run_batch
from atoll.engine.rank.runner import ModelRunner
from atoll.errors import InputError
from atoll.layers.attention import AttentionMetadata
from atoll.engine.rank.kv_cache import make_cache
from atoll.models.checkpoint import Checkpoint, load_weights
from atoll.models.config import ModelConfig
from atoll.models.mtp import DeepseekMTP
from atoll.parallel.mesh import ParallelContext

LAYERS = 3  # the target's decoder layers; the MTP layer is model.layers.3 (an MoE layer)
# the tiny target repeats a token at times after [5, 5, 5] and [7] * 8, where the MTP's drafts
# (near a repeat of the pending token: mtp_fns) pass; elsewhere they mostly fail
PROMPTS = [[5, 7, 9, 11, 13] * 2, [5, 5, 5], [42, 1, 2, 3, 4, 5, 6, 7, 8], [7] * 8]
NEW = 24
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)
EPS = 1e-6  # the tiny config's rms_norm_eps


@pytest.fixture(scope="module")
def with_mtp(tiny_model, tmp_path_factory):
    """(model dir with MTP tensors, transformers' greedy tokens)."""
    base = tiny_model("deepseek_v3", num_hidden_layers=LAYERS)
    d = with_mtp_layer(base, tmp_path_factory.mktemp("tiny-deepseek-mtp"))
    return d, reference_tokens(d, PROMPTS, NEW)


# --- the reference: the report's MTP module in plain torch around transformers' block ------

def _rms(x, w):
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + EPS)) * w


class Reference:
    """The target's hidden states h_i (its last decoder layer's output, before the final norm)
    from transformers, and the MTP module per the DeepSeek-V3 report, section 2.2:
    h'_i = M [RMSNorm(Emb(t_{i+1})); RMSNorm(h_i)] (the released weights' order), then the
    transformer block over positions 0..i (causal), then the shared output head after its norm."""

    def __init__(self, model_dir):
        from safetensors.torch import load_file
        from transformers import AutoModelForCausalLM

        self.target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        t = load_file(str(model_dir / "model.safetensors"))
        p = f"model.layers.{LAYERS}."
        self.emb = t["model.embed_tokens.weight"]
        self.w_e, self.w_h = t[p + "enorm.weight"], t[p + "hnorm.weight"]
        self.eh = t[p + "eh_proj.weight"]
        self.w_n, self.head = t[p + "shared_head.norm.weight"], t[p + "shared_head.head.weight"]
        # the block: transformers' decoder layer N, read from the checkpoint by transformers
        # itself (as a model of N + 1 layers, whose last is the MTP layer's block)
        big = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, num_hidden_layers=LAYERS + 1)
        self.block = big.model.layers[LAYERS].eval()
        self.rotary = self.target.model.rotary_emb

    @torch.no_grad()
    def hidden(self, tokens):
        """[len(tokens), hidden]: the target's h_i at every position."""
        kept = []
        hook = self.target.model.layers[-1].register_forward_hook(
            lambda _m, _a, out: kept.append(out[0] if isinstance(out, tuple) else out))
        try:
            self.target(torch.tensor([tokens]))
        finally:
            hook.remove()
        return kept[0][0]

    @torch.no_grad()
    def mtp(self, h, next_tokens):
        """h: [n, hidden] at positions 0..n-1, next_tokens: t_{i+1} for each -> (the block's
        output [n, hidden] before the head's norm, logits [n, vocab])."""
        n = len(h)
        e = F.embedding(torch.tensor(next_tokens), self.emb)
        x = torch.cat([_rms(e, self.w_e), _rms(h, self.w_h)], dim=-1) @ self.eh.T
        pos = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        out = self.block(x[None], attention_mask=mask, position_ids=pos,
                         position_embeddings=self.rotary(x[None], pos))
        out = (out[0] if isinstance(out, tuple) else out)[0]
        return out, _rms(out, self.w_n) @ self.head.T

    def drafts(self, tokens, k):
        """The K drafts after `tokens` (the last one pending): the MTP over (h_i, t_{i+1}) up to
        the pending token, then applied recurrently on its own output and its own token."""
        hs, ids = self.hidden(tokens[:-1]), list(tokens[1:])
        out = []
        for _ in range(k):
            o, logits = self.mtp(hs, ids)
            out.append(int(logits[-1].argmax()))
            hs, ids = torch.cat([hs, o[-1:]]), ids + [out[-1]]
        return out


@pytest.fixture(scope="module")
def ref(with_mtp):
    return Reference(with_mtp[0])


def test_mtp_forward_matches_the_reference(with_mtp, ref):
    """The MTP layer over a prompt in three chunks (a prefill, a chunk over cached positions,
    one decode-path step), against the reference over the whole sequence at once."""
    model_dir, _ = with_mtp
    config = ModelConfig.load(model_dir)
    mtp = DeepseekMTP(config, ParallelContext.single())
    load_weights(mtp, Checkpoint(model_dir))
    cache = make_cache(config, 1, layers=1, blocks=4, block_size=4, dtype=torch.float32, device="cpu")
    tokens = [42, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10]
    h = ref.hidden(tokens)[:-1]  # h_0..h_9, each with t_{i+1}
    want_out, want_logits = ref.mtp(h, tokens[1:])
    emb = F.embedding(torch.tensor(tokens[1:]), ref.emb)
    got = []
    for start, n in ((0, 6), (6, 3), (9, 1)):
        meta = AttentionMetadata.build([[3, 0, 2]], [start], [n], 4)
        with torch.no_grad():
            got.append(mtp(emb[start:start + n], h[start:start + n], meta, cache))
    got = torch.cat(got)
    torch.testing.assert_close(got, want_out, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(mtp.logits(got), want_logits, atol=2e-4, rtol=2e-4)
    assert not torch.allclose(want_out[:, :8], h[:, :8], atol=1e-2)  # the block did something


def test_engine_drafts_match_the_reference(with_mtp, ref, monkeypatch):
    """Every draft the engine made with K=3 (the first from the catch-up over the target's
    hidden states, the next two recurrent) is the reference's for the same tokens, and the
    MTP state each catch-up leaves is the reference's to float tolerance."""
    model_dir, expected = with_mtp
    seen = []
    propose = mtp_drafter.MtpDrafter.propose

    def recording(self, wants):
        drafts = propose(self, wants)
        seen.extend((list(seq.tokens), k, d) for (seq, k), d in zip(wants, drafts))
        return drafts

    states = []  # (tokens, the MTP's state at the position before the pending token) after each catch-up
    catch_up = mtp_drafter.MtpDrafter._catch_up

    def keeping(self):
        catch_up(self)
        states.extend((list(seq.tokens), h.clone()) for seq, (_, h) in self.ready.items())

    monkeypatch.setattr(mtp_drafter.MtpDrafter, "propose", recording)
    monkeypatch.setattr(mtp_drafter.MtpDrafter, "_catch_up", keeping)
    llm = LLM(model_dir, block_size=4, speculative_config={"method": "deepseek_mtp", "num_speculative_tokens": 3})
    requests = llm.prepare(PROMPTS[:2], GREEDY)
    runner = ModelRunner(llm.spec(requests), ParallelContext.single())
    results = run_batch(runner, requests)
    assert [r["token_ids"] for r in results] == expected[:2]
    assert runner.stats["blocks_held"] == 0
    drafted = [(tokens, k, d) for tokens, k, d in seen if d]
    assert len(drafted) >= 10 and any(len(d) == 3 for _, _, d in drafted)
    for tokens, k, d in drafted:
        assert d == ref.drafts(tokens, k)[:len(d)], tokens
    # the state each catch-up leaves: its cache holds every earlier position from the
    # target's hidden states (a draft's recurrent entry, once verified, rewritten)
    assert len(states) >= len(drafted)
    for tokens, h in states:
        want, _ = ref.mtp(ref.hidden(tokens[:-1]), tokens[1:])
        torch.testing.assert_close(h, want[-1], atol=2e-4, rtol=2e-4)


def _counts(outs):
    m = [o.metrics for o in outs]
    return sum(x["spec_drafted"] for x in m), sum(x["spec_accepted"] for x in m)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["TP1", "TP2", "EP2"])
@pytest.mark.parametrize("k", [1, 2])
def test_greedy_matches_transformers(with_mtp, layout, k):
    model_dir, expected = with_mtp
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": k}
    outs = LLM(model_dir, layout=layout, block_size=4, speculative_config=spec).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    drafted, accepted = _counts(outs)
    assert 0 < accepted < drafted  # both acceptances and rejections happened


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["TP1", "TP2"])
def test_tree_greedy_matches_transformers(with_mtp, layout):
    """Tree drafts (topk 2, 2 deep) verified in one forward over the MLA cache with the tree mask."""
    model_dir, expected = with_mtp
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": 2, "topk": 2}
    outs = LLM(model_dir, layout=layout, block_size=4, speculative_config=spec).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    drafted, accepted = _counts(outs)
    assert 0 < accepted < drafted


def test_checkpoint_without_mtp_refused_in_one_line(tiny_model, tmp_path):
    """config.json declares the layer (transformers' default) but the tensors are not there:
    the run fails in one line naming the first missing tensor; a config without the layer
    says so; a pipeline layout is refused before any rank starts."""
    base = tiny_model("deepseek_v3", num_hidden_layers=LAYERS)
    d = tmp_path / "no-mtp"
    shutil.copytree(base, d)
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    spec = {"method": "deepseek_mtp", "num_speculative_tokens": 2}
    with pytest.raises(InputError, match=f"lacks the multi-token-prediction tensor model.layers.{LAYERS}.enorm.weight"
                                         " and 4 more") as e:
        LLM(d, speculative_config=spec)  # InputError, not a rank's failure: found before any rank starts
    assert "\n" not in str(e.value)
    (d / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 0}))
    with pytest.raises(InputError, match="has no multi-token-prediction layer") as e:
        LLM(d, speculative_config=spec)
    assert "\n" not in str(e.value)
    with pytest.raises(InputError, match="one pipeline stage"):
        LLM(d, layout="PP2", speculative_config=spec)
