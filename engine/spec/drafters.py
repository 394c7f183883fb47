"""Drafters: where speculative tokens come from. The scheduler hands a drafter its decoding
chunks after scheduling the running sequences; the drafter extends each with up to K drafted
tokens (growing its block table for them), so the step's one forward verifies them
(engine.sample.verify). Every rank of a replica drafts the same tokens: the n-gram drafter reads
only the tokens, and the self-draft runs the same forward on every rank of its TP group.

- NgramDrafter: prompt lookup. The sequence's last n tokens (n from prompt_lookup_max down to
  prompt_lookup_min) are searched for earlier in its tokens, latest occurrence first; the
  tokens that followed it are the draft. No model, no cache.
- LayerSkipDrafter: the target's own first `num_layers` layers, its final norm and LM head,
  run K times one token at a time (greedy). It writes those layers' keys and values into
  the target's own cache at the drafted positions; the verify forward then overwrites them
  with the same layers' values, so the draft needs no cache of its own.
- DraftModelDrafter: a separate model of the same vocabulary, on the same ranks and TP, with
  a paged cache of its own that the target's block tables index (same block ids and size).
  A sequence's draft cache holds its tokens up to what it last computed and the target kept;
  each drafting step first catches up the rest (the whole prompt the first time, else the
  pending token and a last accepted draft), then drafts greedily one token at a time.
- MtpDrafter (engine/spec/mtp.py): DeepSeek-V3's multi-token-prediction layer from the target's
  checkpoint, fed the target's own hidden states, applied recurrently for K > 1.
"""

from __future__ import annotations

import torch

from atoll.config.speculative import SpeculativeConfig
from atoll.engine.spec.drafter import Drafter
from atoll.errors import InputError


class NgramDrafter(Drafter):
    def propose(self, wants):
        lo, hi = self.cfg.prompt_lookup_min, self.cfg.prompt_lookup_max
        return [ngram_lookup(seq.tokens, lo, hi, k) for seq, k in wants]


def ngram_lookup(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The k tokens that followed the latest earlier occurrence of the last n tokens, for the
    longest n in hi..lo that occurs; [] when none does."""
    size = len(tokens)
    for n in range(min(hi, size - 1), lo - 1, -1):
        pattern = tokens[size - n:]
        first = pattern[0]
        for i in range(size - n - 1, -1, -1):
            if tokens[i] == first and tokens[i:i + n] == pattern:
                return tokens[i + n:i + n + k]
    return []


class LayerSkipDrafter(Drafter):
    def __init__(self, cfg: SpeculativeConfig, *, max_model_len: int, runner):
        super().__init__(cfg, max_model_len=max_model_len)
        self.num_layers = check(cfg, runner.ctx.layout, len(runner.model.model.layers))
        self.runner = runner

    @torch.inference_mode()
    def propose(self, wants):
        from atoll.layers.attention import AttentionMetadata

        runner = self.runner
        seqs = [seq for seq, _ in wants]
        ks = [k for _, k in wants]
        drafts: list[list[int]] = [[] for _ in wants]
        last = [seq.tokens[-1] for seq in seqs]  # each one's pending token, at position seq.cached
        for step in range(max(ks)):
            live = [i for i, k in enumerate(ks) if k > step]
            meta = AttentionMetadata.build([seqs[i].blocks for i in live], [seqs[i].cached + step for i in live],
                                           [1] * len(live), runner.spec.engine.block_size, device=runner.device)
            ids = torch.tensor([last[i] for i in live], dtype=torch.long, device=runner.device)
            tokens = self.forward(ids, meta).argmax(-1).tolist()
            for i, t in zip(live, tokens):
                drafts[i].append(t)
                last[i] = t
        return drafts

    def forward(self, ids: torch.Tensor, meta) -> torch.Tensor:
        """ids: [seqs] one token each -> logits [seqs, vocab] from the first num_layers layers."""
        model, cache = self.runner.model, self.runner.cache
        h, residual = model.model.embed_tokens(ids), None
        for j, layer in enumerate(list(model.model.layers.values())[:self.num_layers]):
            h, residual = layer(h, residual, meta, cache.k[j], cache.v[j])
        norm = model.model.norm
        return model.lm_head(norm(h, residual=residual) if residual is not None else norm(h))


class DraftModelDrafter(Drafter):
    def __init__(self, cfg: SpeculativeConfig, *, max_model_len: int, runner):
        from atoll.models import ModelConfig, build_model
        from atoll.models.checkpoint import Checkpoint, load_weights

        super().__init__(cfg, max_model_len=max_model_len)
        self.runner = runner
        config = ModelConfig.load(cfg.model)
        self.model = build_model(config, runner.ctx, dtype=runner.dtype, device=runner.device).eval()
        load_weights(self.model, Checkpoint(cfg.model), world=runner.ctx.world)
        self.cache = runner.new_cache(runner.num_blocks + 1, config=config, layers=self.model.num_local_layers)

    @torch.inference_mode()
    def propose(self, wants):
        from atoll.layers.attention import AttentionMetadata

        runner, size = self.runner, self.runner.spec.engine.block_size
        seqs = [seq for seq, _ in wants]
        ks = [k for _, k in wants]
        drafts: list[list[int]] = [[] for _ in wants]
        # catch up: every token the target holds that the draft cache lacks, and the pending one
        starts = [min(seq.draft_cached, seq.cached) for seq in seqs]
        ids = [t for seq, s in zip(seqs, starts) for t in seq.tokens[s:seq.cached + 1]]
        meta = AttentionMetadata.build([seq.blocks for seq in seqs], starts,
                                       [seq.cached + 1 - s for seq, s in zip(seqs, starts)], size, device=runner.device)
        ids = torch.tensor(ids, dtype=torch.long, device=runner.device)
        last = self.model(ids, meta, self.cache).argmax(-1).tolist()
        for step in range(max(ks)):
            for i in range(len(seqs)):
                if ks[i] > step:
                    drafts[i].append(last[i])
            live = [i for i, k in enumerate(ks) if k > step + 1]
            if not live:
                break
            meta = AttentionMetadata.build([seqs[i].blocks for i in live], [seqs[i].cached + 1 + step for i in live],
                                           [1] * len(live), size, device=runner.device)
            out = self.model(torch.tensor([drafts[i][-1] for i in live], dtype=torch.long, device=runner.device),
                             meta, self.cache).argmax(-1).tolist()
            for i, t in zip(live, out):
                last[i] = t
        for seq, k in zip(seqs, ks):
            seq.draft_cached = seq.cached + k  # the pending token and drafts 1..k-1 (kept as far as accepted)
        return drafts


def check(cfg: SpeculativeConfig | None, layout, num_hidden_layers: int, vocab_size: int | None = None) -> int | None:
    """A one-line error when the config cannot run on this layout and model (before any rank
    starts); the layer-skip draft's layer count (its default: a quarter of the layers)."""
    if cfg is None or cfg.method == "ngram":
        return None
    if layout.pp > 1 or layout.dp > 1:
        raise InputError(f"speculative method {cfg.method} runs on one pipeline stage and one DP replica; "
                         f"the layout is {layout}")
    if cfg.method == "draft_model":
        _check_draft(cfg, layout, vocab_size)
        return None
    if cfg.method == "deepseek_mtp":  # the checkpoint is checked as the drafter loads (engine.spec.mtp.check_mtp)
        return None
    layers = cfg.num_layers or max(1, num_hidden_layers // 4)
    if layers >= num_hidden_layers:
        raise InputError(f"speculative num_layers={layers} must be below the model's {num_hidden_layers} layers")
    return layers


def _check_draft(cfg: SpeculativeConfig, layout, vocab_size: int | None) -> None:
    from atoll.models import ModelConfig

    if cfg.draft_tensor_parallel_size not in (None, layout.tp):
        raise InputError(f"speculative draft_tensor_parallel_size={cfg.draft_tensor_parallel_size}: the draft model "
                         f"runs at the target's tp={layout.tp}")
    config = ModelConfig.load(cfg.model)
    if vocab_size is not None and config.vocab_size != vocab_size:
        raise InputError(f"the draft model's vocabulary ({config.vocab_size} tokens) is not the target's "
                         f"({vocab_size}): a draft model must share the tokenizer")
    layout.validate(config)


def make_drafter(cfg: SpeculativeConfig | None, runner, *, max_model_len: int) -> Drafter | None:
    if cfg is None:
        return None
    if cfg.method == "ngram":
        return NgramDrafter(cfg, max_model_len=max_model_len)
    if cfg.method == "draft_model":
        return DraftModelDrafter(cfg, max_model_len=max_model_len, runner=runner)
    if cfg.method == "deepseek_mtp":
        from atoll.engine.spec.mtp import MtpDrafter  # lazy: engine.spec.mtp builds on this module's Drafter

        return MtpDrafter(cfg, max_model_len=max_model_len, runner=runner)
    return LayerSkipDrafter(cfg, max_model_len=max_model_len, runner=runner)
