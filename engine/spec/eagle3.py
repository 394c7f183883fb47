"""The EAGLE-3 drafter: `{"method": "eagle3", "model": DIR, "num_speculative_tokens": K}`.

The head (models/eagle3.py) reads, at position i, g_i = fc(the target's hidden states at three
layers, concatenated) and Emb(t_{i+1}), and predicts t_{i+2} over its draft vocabulary, mapped
to target ids by d2t. It runs on the target's ranks, sharded as the target is, with a paged
cache of its own (one layer) that the target's block tables index.

The three hidden states come from the target's own forward: a forward pre-hook on each chosen
layer keeps the residual stream entering it (every row; a compiled step's padding rows past the
micro-batch's tokens are dropped). The hooks fire under the compiled CPU step too (it swaps a
layer's forward, not its __call__); under CUDA graphs a replayed step runs no hook, so there a
decode step's states are not seen and the head drafts nothing after it.

A step's drafting, at schedule time (Drafter.extend), as the MTP drafter's (engine/spec/mtp.py):
1. Catch up: for every sequence of the previous micro-batch, the head runs over the positions
   the target computed and kept, (g_i, t_{i+1}) for i from the chunk's start to cached - 1,
   which writes its cache there. The output at cached - 1 is the state its drafts start from.
   This runs every step, drafting or not, so the head's cache misses no position.
2. Draft: d_1 = the head's token from that state; for K > 1 the head runs recurrently, one
   position at a time, on its own output (before `norm`) and its own draft (vLLM's and SGLang's
   chain). Those cache entries are overwritten by the next catch-up.
"""

from __future__ import annotations

import torch

from atoll.config.speculative import SpeculativeConfig
from atoll.engine.spec.drafter import Drafter, kept_positions
from atoll.engine.spec.tree_draft import draft_trees
from atoll.errors import InputError
from atoll.layers.attention import AttentionMetadata
from atoll.models.checkpoint import Checkpoint, load_weights
from atoll.models.eagle3 import Eagle3Head, aux_layers, check_head


class Eagle3Drafter(Drafter):
    method = "eagle3"

    @classmethod
    def check(cls, cfg, layout, config, model_dir) -> None:
        super().check(cfg, layout, config, model_dir)
        if config.model_type not in ("llama", "mistral", "qwen2", "qwen3"):
            raise InputError(f"speculative method eagle3 drafts for Llama-style targets; {model_dir} is "
                             f"{config.model_type}")
        check_head(cfg.model, config)

    def __init__(self, cfg: SpeculativeConfig, *, max_model_len: int, runner):
        super().__init__(cfg, max_model_len=max_model_len)
        self.runner = runner
        # one head and one set of hooks a runner and head directory: a runner that runs several
        # engines (atoll bench spec's sides) loads it once, and its hooks keep only while eagle3 runs
        heads = runner.__dict__.setdefault("eagle3_heads", {})
        if cfg.model not in heads:
            heads[cfg.model] = _load(cfg.model, runner)
        self.head, self.tap = heads[cfg.model]
        self.cache = runner.new_cache(runner.num_blocks + 1, config=self.head.config, layers=1)
        self.embed = self.head.embed_tokens if hasattr(self.head, "embed_tokens") else runner.model.model.embed_tokens
        self.tap.kept.clear()
        self.scheduled: list = []  # the previous micro-batch's chunks: the scheduler's own list
        self.ready: dict = {}  # sequence -> (its cached, the head's state [H] at cached - 1)

    def extend(self, chunks, pool, budget: int, *, running: int) -> int:
        self._catch_up()
        self.scheduled = chunks  # by the next step it holds the whole micro-batch, in row order
        return super().extend(chunks, pool, budget, running=running)

    @torch.inference_mode()
    def _catch_up(self) -> None:
        chunks, kept, layers = self.scheduled, dict(self.tap.kept), self.tap.ids
        self.scheduled, self.ready = [], {}
        self.tap.kept.clear()
        total = sum(c.count for c in chunks)
        if not chunks or len(kept) != len(set(layers)) or any(len(t) < total for t in kept.values()):
            return
        size = self.runner.spec.engine.block_size
        rows, ids, seqs, starts, counts = kept_positions(chunks, size)
        if not seqs:
            return
        device = self.runner.device
        at = torch.tensor(rows, dtype=torch.long, device=device)
        g = self.head.fc(torch.cat([kept[i][at] for i in layers], dim=-1))
        meta = AttentionMetadata.build([s.blocks for s in seqs], starts, counts, size, device=device)
        out = self.head(self.embed(torch.tensor(ids, dtype=torch.long, device=device)), g, meta, self.cache)
        end = -1
        for seq, start, n in zip(seqs, starts, counts):
            end += n
            if start + n == seq.cached and seq.length == seq.cached + 1:  # decoding next
                self.ready[seq] = (seq.cached, out[end])

    @torch.inference_mode()
    def propose(self, wants):
        drafts: list[list[int]] = [[] for _ in wants]
        live = [i for i, (seq, _) in enumerate(wants) if self.ready.get(seq, (None,))[0] == seq.cached]
        if not live:
            return drafts
        device, size = self.runner.device, self.runner.spec.engine.block_size
        h = torch.stack([self.ready[wants[i][0]][1] for i in live])  # [live, H]
        for step in range(max(wants[i][1] for i in live)):
            tokens = self.head.tokens(h)  # [live] target ids
            for i, t in zip(live, tokens.tolist()):
                drafts[i].append(t)
            more = [j for j, i in enumerate(live) if wants[i][1] > step + 1]
            if not more:
                break
            seqs = [wants[live[j]][0] for j in more]
            meta = AttentionMetadata.build([s.blocks for s in seqs], [s.cached + step for s in seqs], [1] * len(seqs),
                                           size, device=device)
            at = torch.tensor(more, dtype=torch.long, device=device)
            h = self.head(self.embed(tokens[at]), h[at], meta, self.cache)
            live = [live[j] for j in more]
        return drafts

    @torch.inference_mode()
    def propose_tree(self, wants):
        """[(sequence, depth, nodes)] -> each sequence's tree (engine.spec.tree_draft), from the
        head's state at its last cached position."""
        head = self.head
        return draft_trees(
            wants, self.ready, topk=self.cfg.topk, block_size=self.runner.spec.engine.block_size,
            device=self.runner.device, logits=lambda h: head.lm_head(head.norm(h)),
            step=lambda ids, h, meta: head(self.embed(ids), h, meta, self.cache),
            to_target=lambda ids: (torch.tensor(ids, dtype=torch.long, device=head.d2t.device)
                                   + head.d2t[ids]).tolist())  # draft ids -> target ids


class Tap:
    """Forward pre-hooks on the target layers the head reads: each keeps the residual stream
    entering its layer, every row, while the runner's speculative method is eagle3."""

    def __init__(self, runner, ids: list[int]):
        self.runner, self.ids, self.kept = runner, ids, {}
        layers = runner.model.model.layers
        for i in sorted(set(ids)):
            layers[str(i)].register_forward_pre_hook(lambda _m, args, i=i: self._keep(i, args))

    def _keep(self, index: int, args) -> None:
        speculative = self.runner.spec.engine.speculative_config
        if speculative is None or speculative.method != "eagle3":
            return
        x, residual = args[0], args[1]
        self.kept[index] = x.clone() if residual is None else residual + x  # [rows, H]


def _load(model_dir, runner) -> tuple[Eagle3Head, Tap]:
    """The head on this rank (its shard), filled from its directory, and the hooks feeding it."""
    head_cfg, header = check_head(model_dir, runner.config)
    with torch.device(runner.device):
        head = Eagle3Head(head_cfg, runner.ctx, own_embedding="embed_tokens.weight" in header,
                          dtype=runner.dtype).eval()
    checkpoint = Checkpoint(model_dir)
    load_weights(head, checkpoint)  # every parameter filled, else one line naming the tensor
    head.load_maps(checkpoint)
    return head, Tap(runner, aux_layers(head_cfg.raw, runner.config.num_hidden_layers))
