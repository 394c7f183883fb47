"""ModelRunner: one rank's stage of the model, its KV cache, and the tick that moves the
micro-batches in flight one stage on and hands sampled tokens to every rank."""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

import torch

from atoll.layers.attention import KVCache
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
    num_blocks: int = 0  # 0: enough for max_num_seqs sequences of max_model_len per pipeline lane

    def __post_init__(self):
        if self.num_blocks == 0:
            from atoll.parallel.layout import Layout

            per_seq = -(-self.max_model_len // self.block_size)
            object.__setattr__(self, "num_blocks", self.max_num_seqs * per_seq * Layout.parse(self.layout).pp)


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
        self._sending = None  # the isend of the last activations, until it completes
        self.packer = _packer(self.model, int(os.environ.get("LOCAL_WORLD_SIZE", ctx.layout.world_size)))
        self.stats: dict = {}

    def agree(self, busy: bool, mb):
        """With DP every replica ticks while any is busy and runs a micro-batch slot when any
        has one (the MoE layers need every replica): an empty one stands in. Returns (go, mb)."""
        if self.ctx.layout.dp == 1:
            return busy, mb
        flags = self.ctx.world.all_reduce(torch.tensor([int(busy), int(mb is not None)]))
        if flags[1] and mb is None:
            from atoll.engine.lanes import MicroBatch

            mb = MicroBatch.of([], self.spec.block_size)
        return bool(flags[0]), mb

    def start_run(self) -> None:
        self.stats = {"busy_s": 0.0, "ticks": 0, "worked": 0, "started": time.perf_counter()}

    def end_run(self) -> None:
        """Waits for the last activations sent. Stats: ticks, worked (ticks this stage computed
        in), busy_s (time computing, not waiting for activations or tokens), wall_s, busy."""
        self._wait_send()
        st = self.stats
        st["wall_s"] = time.perf_counter() - st.pop("started")
        st["busy"] = st["busy_s"] / st["wall_s"] if st["wall_s"] else 0.0

    @torch.inference_mode()
    def tick(self, inflight) -> torch.Tensor | None:
        """inflight[s]: the micro-batch at stage s (None: none). This rank's stage computes its
        one, taking the activations from the previous stage and sending its output on without
        waiting; when inflight[pp - 1] leaves the last stage, every rank gets its sampled tokens."""
        ctx, pp = self.ctx, self.ctx.layout.pp
        stage = ctx.pp.rank
        mb = inflight[stage] if stage < len(inflight) else None
        out = None
        self.stats["ticks"] += 1
        if mb is not None:
            if ctx.is_first_stage:
                x = mb.ids
            else:
                x = ctx.pp.recv((len(mb.ids), self.config.hidden_size), self.dtype, src=stage - 1)
            t0 = time.perf_counter()
            self.stats["worked"] += 1
            if self.packer is not None and mb.meta.is_decode:
                self.packer.observe(len(mb.ids))
            out = self.model(x, mb.meta, self.cache)
            if not ctx.is_last_stage:
                self._wait_send()
                self._sending = ctx.pp.isend(out, dst=stage + 1)
            elif ctx.rank == self.sampler_rank and mb.chunks:
                out = mb.sample(out.float())
            self.stats["busy_s"] += time.perf_counter() - t0
        done = inflight[pp - 1] if len(inflight) == pp else None
        if done is None:
            return None
        seqs = len(done.chunks)
        if ctx.layout.dp == 1:
            tokens = out if ctx.rank == self.sampler_rank else torch.empty(seqs, dtype=torch.long)
            return ctx.world.broadcast(tokens, src=self.sampler_rank)
        # each DP replica samples its own sequences; one all_reduce hands every rank its row
        table = torch.zeros(ctx.layout.dp, self.spec.max_num_seqs, dtype=torch.long)
        if ctx.rank == self.sampler_rank and seqs:
            table[ctx.coords.dp, :seqs] = out
        return ctx.world.all_reduce(table)[ctx.coords.dp, :seqs]

    def _wait_send(self) -> None:
        if self._sending is not None:
            self._sending.wait()
            self._sending = None


def _packer(model, ranks_here: int):
    """MKL-packed decode weights for a CPU float32 model (layers.packed), or None: also when
    the second copy of the weights would take more than a quarter of this machine's free
    memory, shared by its ranks."""
    from atoll.engine.blocks import available_memory
    from atoll.layers import packed
    from atoll.layers.embedding import ParallelLMHead
    from atoll.layers.linear import ColumnParallelLinear, ReplicatedLinear, RowParallelLinear

    kinds = (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear, ParallelLMHead)
    weights = [m.weight for m in model.modules() if isinstance(m, kinds)]
    if not packed.available() or not weights or weights[0].device.type != "cpu":
        return None
    extra = sum(w.numel() * w.element_size() for w in weights)
    if extra * ranks_here > available_memory() // 4:
        return None
    return packed.Packer(weights)
