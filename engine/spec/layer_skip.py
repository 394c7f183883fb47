"""The layer-skip self-draft: the target's own first `num_layers` layers, its final norm and LM
head, run K times one token at a time (greedy). It writes those layers' keys and values into the
target's own cache at the drafted positions; the verify forward then overwrites them with the
same layers' values, so the draft needs no cache of its own. Every rank of the TP group runs
the same forward, so all draft the same tokens."""

from __future__ import annotations

import torch

from atoll.config.speculative import SpeculativeConfig
from atoll.engine.spec.drafter import Drafter
from atoll.errors import InputError
from atoll.layers.attention import AttentionMetadata


def draft_layers(cfg: SpeculativeConfig, num_hidden_layers: int) -> int:
    """The layers the draft runs: num_layers, by default a quarter of the model's; fewer than all."""
    layers = cfg.num_layers or max(1, num_hidden_layers // 4)
    if layers >= num_hidden_layers:
        raise InputError(f"speculative num_layers={layers} must be below the model's {num_hidden_layers} layers")
    return layers


class LayerSkipDrafter(Drafter):
    method = "layer_skip"

    def __init__(self, cfg: SpeculativeConfig, *, max_model_len: int, runner):
        super().__init__(cfg, max_model_len=max_model_len)
        self.num_layers = draft_layers(cfg, len(runner.model.model.layers))
        self.runner = runner

    @classmethod
    def check(cls, cfg, layout, config, model_dir) -> None:
        super().check(cfg, layout, config, model_dir)
        draft_layers(cfg, config.num_hidden_layers)

    @torch.inference_mode()
    def propose(self, wants):
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
