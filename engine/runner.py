"""ModelRunner: one rank's stage of the model, its KV cache, and the step that moves
activations between pipeline stages and hands sampled tokens to every rank."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from atoll.layers.attention import AttentionMetadata, KVCache
from atoll.layers.linear import kv_heads_per_rank
from atoll.models import ModelConfig, build_model
from atoll.models.checkpoint import Checkpoint, load_weights
from atoll.parallel.mesh import ParallelContext

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class RunSpec:
    """What every rank needs to build its part of the model; picklable."""

    model_dir: str
    layout: str
    dtype: str = "float32"
    max_num_seqs: int = 32
    max_model_len: int = 2048
    max_num_batched_tokens: int = 2048
    block_size: int = 16
    num_blocks: int = 0  # 0: enough for max_num_seqs sequences of max_model_len

    def __post_init__(self):
        if self.num_blocks == 0:
            per_seq = -(-self.max_model_len // self.block_size)
            object.__setattr__(self, "num_blocks", self.max_num_seqs * per_seq)


class ModelRunner:
    def __init__(self, spec: RunSpec, ctx: ParallelContext):
        self.spec, self.ctx = spec, ctx
        self.dtype = DTYPES[spec.dtype]
        self.config = ModelConfig.load(spec.model_dir)
        self.model = build_model(self.config, ctx, dtype=self.dtype).eval()
        self.checkpoint = Checkpoint(spec.model_dir)
        load_weights(self.model, self.checkpoint)
        cfg, tp = self.config, ctx.tp.size
        kv_local = kv_heads_per_rank(cfg.num_key_value_heads, tp)
        self.cache = KVCache(self.model.num_local_layers, spec.num_blocks, kv_local, spec.block_size,
                             cfg.head_dim, self.dtype)
        lay = ctx.layout
        # the rank that samples for this rank's DP replica: last stage, same dp, tp rank 0
        self.sampler_rank = (lay.pp - 1) * lay.stage_size + ctx.coords.dp * lay.tp

    def any_work(self, mine: bool) -> bool:
        """With DP, every DP rank steps while any has work: the MoE layers need them all."""
        if self.ctx.layout.dp == 1:
            return mine
        flag = torch.tensor([int(mine)])
        return bool(self.ctx.world.all_reduce(flag).item())

    @torch.inference_mode()
    def step(self, ids: torch.Tensor, meta: AttentionMetadata, sample_fn) -> torch.Tensor:
        """ids: [tokens] (every rank knows them). Returns the sampled [seqs] on every rank."""
        ctx = self.ctx
        if ctx.is_first_stage:
            x = ids
        else:
            x = ctx.pp.recv((len(ids), self.config.hidden_size), self.dtype, src=ctx.pp.rank - 1)
        out = self.model(x, meta, self.cache)
        if not ctx.is_last_stage:
            ctx.pp.send(out, dst=ctx.pp.rank + 1)
        seqs = len(meta.query_lens)
        if ctx.layout.dp == 1:
            tokens = sample_fn(out.float()) if ctx.rank == self.sampler_rank else torch.empty(seqs, dtype=torch.long)
            return ctx.world.broadcast(tokens, src=self.sampler_rank)
        # each DP replica samples its own sequences; one all_reduce hands every rank its row
        table = torch.zeros(ctx.layout.dp, self.spec.max_num_seqs, dtype=torch.long)
        if ctx.rank == self.sampler_rank and seqs:
            table[ctx.coords.dp, :seqs] = sample_fn(out.float())
        return ctx.world.all_reduce(table)[ctx.coords.dp, :seqs]
