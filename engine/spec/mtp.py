"""The DeepSeek-V3 multi-token-prediction drafter: `{"method": "deepseek_mtp", "num_speculative_tokens": K}`.

The MTP layer (models/mtp.py) at position i reads h_i, the target's last hidden state there
(before the final norm), and the next token t_{i+1}, and predicts t_{i+2}. It is loaded from
the target's own checkpoint (model.layers.{num_hidden_layers}.*) on the target's ranks and
sharded as the target is, with a paged latent cache of its own (one layer) that the target's
block tables index, so its attention sees the whole sequence.

A step's drafting, at schedule time (Drafter.extend):
1. Catch up: the previous micro-batch's forward left each position's hidden state (a hook on
   the target's last decoder layer keeps residual + output, every row). For every sequence
   of that micro-batch, the MTP runs over the positions the target computed and kept,
   (h_i, t_{i+1}) for i from the chunk's start to seq.cached - 1 (its tokens are known now,
   the pending one included), which writes its cache at those positions. At a decoding
   sequence's last position, cached - 1, the output is the state its drafts start from.
   This runs every step, drafting or not (disable_by_batch_size), so the MTP cache misses no
   position: its cost is one decoder layer over the step's tokens.
2. Draft: for each decoding sequence, shared_head gives d_1 = t_{cached+1} from that state;
   for K > 1 the MTP is applied recurrently, one position at a time: position cached - 1 + j
   takes its own previous output as h and its own d_j as the token, and gives d_{j+1} (as
   vLLM and SGLang run one MTP layer for K > 1). Those positions' cache entries are
   overwritten by the next catch-up with the target's hidden states of the accepted tokens.

A sequence whose last computation was not in the previous micro-batch drafts nothing this
step. With prefix caching, the MTP entries of a found block are the ones the sequence that
computed it wrote (its last position's used that sequence's next token): only the drafts'
quality can differ, never the tokens, which the verify step decides.
"""

from __future__ import annotations

import torch

from atoll.config.speculative import SpeculativeConfig
from atoll.engine.spec.drafter import Drafter, kept_positions
from atoll.engine.spec.tree_draft import draft_trees
from atoll.errors import InputError
from atoll.layers.attention import AttentionMetadata
from atoll.models.checkpoint import load_weights
from atoll.models.mtp import OWN, DeepseekMTP, mtp_layers
from atoll.models.safetensors_header import tensor_names


def check_mtp(model_dir, config) -> None:
    """One line when the checkpoint holds no MTP layer for deepseek_mtp to draft with."""
    if config.model_type not in ("deepseek_v3", "deepseek_v2"):
        raise InputError(f"speculative method deepseek_mtp needs a DeepSeek-V3 checkpoint with its "
                         f"multi-token-prediction layer; {model_dir} is {config.model_type}")
    if mtp_layers(config) < 1:
        raise InputError(f"speculative method deepseek_mtp: {model_dir} has no multi-token-prediction layer "
                         f"(config.json num_nextn_predict_layers is {config.raw.get('num_nextn_predict_layers')})")
    names = tensor_names(model_dir)
    missing = [f"model.layers.{config.num_hidden_layers}.{n}" for n in OWN
               if f"model.layers.{config.num_hidden_layers}.{n}" not in names]
    if missing:
        raise InputError(f"speculative method deepseek_mtp: checkpoint {model_dir} lacks the multi-token-prediction "
                         f"tensor {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))


class MtpDrafter(Drafter):
    method = "deepseek_mtp"

    @classmethod
    def check(cls, cfg, layout, config, model_dir) -> None:
        super().check(cfg, layout, config, model_dir)
        check_mtp(model_dir, config)  # its tensors in the checkpoint

    def __init__(self, cfg: SpeculativeConfig, *, max_model_len: int, runner):
        super().__init__(cfg, max_model_len=max_model_len)
        check_mtp(runner.spec.model_dir, runner.config)
        self.runner = runner
        with torch.device(runner.device):
            self.mtp = DeepseekMTP(runner.config, runner.ctx, dtype=runner.dtype, engine=runner.spec.engine).eval()
        load_weights(self.mtp, runner.checkpoint)  # every MTP parameter filled, else one line naming the tensor
        self.cache = runner.new_cache(runner.num_blocks + 1, layers=1)
        self.embed = runner.model.model.embed_tokens  # shared with the target
        # the target's last hidden states, every row of its last forward: the final norm is
        # fused with the last residual add, so they are kept as the last layer returns them
        self.hidden: torch.Tensor | None = None
        list(runner.model.model.layers.values())[-1].register_forward_hook(self._keep)
        self.scheduled: list = []  # the previous micro-batch's chunks: the scheduler's own list
        self.ready: dict = {}  # sequence -> (its cached, the MTP state [hidden] at cached - 1)

    def _keep(self, _layer, _args, out) -> None:
        h, residual = out
        self.hidden = h if residual is None else residual + h  # [tokens, hidden]

    def extend(self, chunks, pool, budget: int, *, running: int) -> int:
        self._catch_up()
        # the scheduler appends the admitted prompts' chunks to this same list after drafting:
        # by the next step it holds the whole micro-batch, in the order of the forward's rows
        self.scheduled = chunks
        return super().extend(chunks, pool, budget, running=running)

    @torch.inference_mode()
    def _catch_up(self) -> None:
        chunks, hidden = self.scheduled, self.hidden
        self.scheduled, self.hidden, self.ready = [], None, {}
        if not chunks or hidden is None or len(hidden) != sum(c.count for c in chunks):
            return
        size = self.runner.spec.engine.block_size
        rows, ids, seqs, starts, counts = kept_positions(chunks, size)
        if not seqs:
            return
        device = self.runner.device
        meta = AttentionMetadata.build([s.blocks for s in seqs], starts, counts, size, device=device)
        h = hidden[torch.tensor(rows, dtype=torch.long, device=device)]
        out = self.mtp(self.embed(torch.tensor(ids, dtype=torch.long, device=device)), h, meta, self.cache)
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
        h = torch.stack([self.ready[wants[i][0]][1] for i in live])  # [live, hidden]
        for step in range(max(wants[i][1] for i in live)):
            tokens = self.mtp.logits(h).argmax(-1)  # [live]
            for i, t in zip(live, tokens.tolist()):
                drafts[i].append(t)
            more = [j for j, i in enumerate(live) if wants[i][1] > step + 1]
            if not more:
                break
            seqs = [wants[live[j]][0] for j in more]
            # position cached + step: h is the MTP's own output, the token its own draft
            meta = AttentionMetadata.build([s.blocks for s in seqs], [s.cached + step for s in seqs], [1] * len(seqs),
                                           size, device=device)
            at = torch.tensor(more, dtype=torch.long, device=device)
            h = self.mtp(self.embed(tokens[at]), h[at], meta, self.cache)
            live = [live[j] for j in more]
        return drafts

    @torch.inference_mode()
    def propose_tree(self, wants):
        """[(sequence, depth, nodes)] -> each sequence's tree (engine.spec.tree_draft), from the
        MTP layer's state at its last cached position."""
        return draft_trees(wants, self.ready, topk=self.cfg.topk, block_size=self.runner.spec.engine.block_size,
                           device=self.runner.device, logits=self.mtp.logits,
                           step=lambda ids, h, meta: self.mtp(self.embed(ids), h, meta, self.cache))
