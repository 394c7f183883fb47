"""The draft-model drafter: a separate model of the same vocabulary, on the same ranks and TP,
with a paged cache of its own that the target's block tables index (same block ids and size).
A sequence's draft cache holds its tokens up to what it last computed and the target kept; each
drafting step first catches up the rest (the whole prompt the first time, else the pending
token and a last accepted draft), then drafts greedily one token at a time."""

from __future__ import annotations

import torch

from atoll.config.speculative import SpeculativeConfig
from atoll.engine.spec.drafter import Drafter
from atoll.errors import InputError
from atoll.layers.attention import AttentionMetadata
from atoll.models import ModelConfig, build_model
from atoll.models.checkpoint import Checkpoint, load_weights


class DraftModelDrafter(Drafter):
    method = "draft_model"

    @classmethod
    def check(cls, cfg, layout, config, model_dir) -> None:
        """Its tp is the target's, its vocabulary the target's, and the layout fits it."""
        super().check(cfg, layout, config, model_dir)
        if cfg.draft_tensor_parallel_size not in (None, layout.tp):
            raise InputError(f"speculative draft_tensor_parallel_size={cfg.draft_tensor_parallel_size}: the draft "
                             f"model runs at the target's tp={layout.tp}")
        draft = ModelConfig.load(cfg.model)
        if draft.vocab_size != config.vocab_size:
            raise InputError(f"the draft model's vocabulary ({draft.vocab_size} tokens) is not the target's "
                             f"({config.vocab_size}): a draft model must share the tokenizer")
        layout.validate(draft)

    def __init__(self, cfg: SpeculativeConfig, *, max_model_len: int, runner):
        super().__init__(cfg, max_model_len=max_model_len)
        self.runner = runner
        config = ModelConfig.load(cfg.model)
        self.model = build_model(config, runner.ctx, dtype=runner.dtype, device=runner.device,
                                 engine=runner.spec.engine).eval()
        load_weights(self.model, Checkpoint(cfg.model), world=runner.ctx.world)
        self.cache = runner.new_cache(runner.num_blocks + 1, config=config, layers=self.model.num_local_layers)

    @torch.inference_mode()
    def propose(self, wants):
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
