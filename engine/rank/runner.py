"""ModelRunner: one rank's stage of the model, its KV cache, and the tick that moves the
micro-batches in flight one stage on and hands sampled tokens to every rank."""

from __future__ import annotations

import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from atoll.engine.kv.sizing import kv_bytes_per_block
from atoll.engine.rank.eplb import ExpertBalancer
from atoll.engine.rank.kv_cache import make_cache, scales_for, size_cache
from atoll.engine.rank.kv_tiers import RankTiers
from atoll.engine.rank.run_spec import RunSpec, resolve_dtype
from atoll.engine.rank.tuning import packer_for, tune_eager
from atoll.engine.sample.grammar import Grammars
from atoll.engine.sample.micro_batch import MicroBatch
from atoll.engine.sample.tree import compact
from atoll.engine.step import policy as step_policy
from atoll.engine.step.two_batch import TwoBatchOverlap
from atoll.layers.attention import KVCache
from atoll.layers.context_parallel import CpShards
from atoll.models import ModelConfig, build_model
from atoll.models import quantize
from atoll.models.checkpoint import Checkpoint, load_weights
from atoll.parallel.mesh import ParallelContext
from atoll.parallel.pipeline import stage_layers

class ModelRunner:
    def __init__(self, spec: RunSpec, ctx: ParallelContext, *, ranks_here: int | None = None, load=None):
        """ranks_here: ranks sharing this machine's memory (the launcher says; default the layout's);
        load(model, checkpoint): fills the weights instead of reading them all (elastic EP's survivors)."""
        self.spec, self.ctx = spec, ctx
        self.device = ctx.device
        self.config = ModelConfig.load(spec.model_dir)
        self.dtype = resolve_dtype(spec.engine.dtype, self.config, self.device)
        self.model = build_model(self.config, ctx, dtype=self.dtype, device=self.device, engine=spec.engine).eval()
        self.checkpoint = Checkpoint(spec.model_dir)
        quantize.prepare(self.model, spec.engine.quantization, self.checkpoint)  # fp8 weights made before they are read
        # each slice goes to the device as it is read; every rank checks that some rank read each tensor
        if load is None:
            load_weights(self.model, self.checkpoint, world=ctx.world)
        else:
            load(self.model, self.checkpoint)
        quantize.apply(self.model, spec.engine.quantization)  # --quantization: int8/fp8 weights (models/quantize.py)
        self.bytes_per_block = kv_bytes_per_block(self.config, ctx.layout, self.dtype.itemsize, spec.engine.block_size,
                                                  kv_cache_dtype=spec.engine.kv_cache_dtype)
        # (widest window, blocks) when the sliding layers keep their own cache (engine.kv.windowed)
        self.window_pool: tuple[int, int] | None = None
        self.num_blocks = size_cache(self)
        # fp8's fixed scales for this rank's layers and heads (models/kv_scales.py), or a fit on the first prefill
        self.kv_scales, self.fit_kv_scales, how = scales_for(self)
        if how and ctx.rank == 0:
            print(f"atoll: fp8 KV cache scales {how}", file=sys.stderr, flush=True)
        # one block more than the schedulers hand out: the compiled step's padding rows write there
        self.cache = self.new_cache(self.num_blocks + 1, main=True,
                                    window_blocks=self.window_pool[1] + 1 if self.window_pool else None)
        lay = ctx.layout
        # the rank that samples for this rank's DP replica: last stage, same dp, tp rank 0
        self.sampler_rank = (lay.pp - 1) * lay.stage_size + ctx.coords.dp * lay.tp
        # structured outputs' grammars and the thread that fills their masks beside the forward
        # (engine.sample.grammar, engine.sample.masks): made on the first request that has one
        eos = self.config.eos_token_id
        self.grammars = Grammars(spec.model_dir, self.config.vocab_size, eos[0] if eos else None)
        self._mask_pool: ThreadPoolExecutor | None = None
        self._sending = None  # the isend of the last activations, until it completes
        self.logprobs: torch.Tensor | None = None  # the last tick's logprob rows, on a replica's leader
        self.prompt_logprobs: torch.Tensor | None = None  # ... and its prompt-logprob rows
        self.ranks_here = ranks_here or ctx.layout.world_size
        # None: every step eager (always under context parallelism, whose steps are eager only)
        # and with a sliding layers' cache of their own, whose tables the compiled steps do not take
        self.decode_step = step_policy.build(self) if ctx.layout.cp == 1 and self.window_pool is None else None
        self.packer = packer_for(self.model, self.ranks_here, spec.engine.mkl_pack) if self.decode_step is None else None
        # whether the eager step runs the weights tune_eager chose (False: plain F.linear products)
        self.eager_tuned = self.decode_step is None and self.packer is None and tune_eager(self)
        self.stats: dict = {}
        self.kv_tiers = RankTiers.build(self)  # --kv-offload-gb, --kv-disk-dir, --kv-shared (None: none)
        self.last_graphed = False  # whether the last tick ran the compiled decode step (the step trace says)
        self.graphed_steps = 0  # the ticks that ran it, for reading (tests, benches)
        # MoE: the expert load window, and --enable-eplb's rebalances (engine/rank/eplb.py); None: dense
        self.balancer = ExpertBalancer.build(self)
        self.two_batch = TwoBatchOverlap.build(self)  # --enable-two-batch-overlap (None: off, or dense)

    @property
    def step_together(self) -> bool:
        """MoE with DP and a decode step: the MoE layers' fixed-shape exchange needs every
        replica at one bucket, agreed each step (agree)."""
        return self.decode_step is not None and self.config.is_moe and self.ctx.layout.dp > 1

    @property
    def spec_k(self) -> int | None:
        """Speculative tokens per step (the width of the tokens a tick hands round is 1 + K), or None."""
        speculative = self.spec.engine.speculative_config
        return speculative.k if speculative is not None else None

    def new_cache(self, blocks: int, *, config: ModelConfig | None = None, layers: int | None = None,
                  window_blocks: int | None = None, main: bool = False):
        """A paged cache of `blocks` blocks for this rank's layers, of the model's attention kind
        (or another model's: a draft model's, engine.spec.registry); window_blocks: the sliding layers'
        own count (engine.kv.windowed). main: the model's own cache, which takes the fp8 scales read
        for its layers (another cache: a drafter's, or a profiling scratch, scale 1 or its own fit)."""
        if window_blocks is not None:
            blocks = [window_blocks if w else blocks for w in self.local_windows()]
        return make_cache(config or self.config, self.ctx.tp.size, layers=layers or self.model.num_local_layers,
                          blocks=blocks,
                          block_size=self.spec.engine.block_size, dtype=self.dtype, device=self.device,
                          kv_cache_dtype=self.spec.engine.kv_cache_dtype,
                          scales=self.kv_scales if main else None, fit_first=self.spec.engine.calculate_kv_scales)

    def local_windows(self) -> list[int | None]:
        """Each of this rank's layers' sliding window (None: full attention)."""
        start, end = stage_layers(self.config, self.ctx.layout.pp)[self.ctx.coords.pp]
        return [self.config.window_of(i) for i in range(start, end)]

    def out_width(self, mb) -> int:
        """Tokens a micro-batch hands round per sequence: 1, 1 + K with speculation, or more
        where a request draws for its copies (n > 1); under DP every replica the same."""
        return mb.out_width if mb.out_width is not None else max(1 + (self.spec_k or 0), mb.draws)

    def agree(self, busy: bool, mb):
        """With DP every replica ticks while any is busy and runs a micro-batch slot when any
        has one (the MoE layers need every replica): an empty one stands in; the replicas'
        extra token widths (copies drawn) are added up, so all hand round one width. With
        step_together the same all-reduce settles the decode step (mb.step_rows): every replica
        at the largest one's rows, or every replica eager where any cannot take the step.
        Returns (go, mb)."""
        if self.ctx.layout.dp == 1:
            return busy, mb
        lay = self.ctx.layout
        base = 1 + (self.spec_k or 0)
        extra = self.out_width(mb) - base if mb is not None else 0
        # with step_together, also whether a replica cannot take the decode step, and each
        # replica's rows (every rank of a replica says the same: summed, then divided)
        flags = [int(busy), int(mb is not None), extra, 0] + [0] * lay.dp
        if self.step_together and mb is not None:
            flags[3] = int(bool(mb.chunks) and (self.cache.pending or not self.decode_step.takes(mb)))
            flags[4 + self.ctx.coords.dp] = mb.tokens
        flags = torch.tensor(flags, dtype=torch.long, device=self.device)
        busy, some, extra, cannot, *rows = self.ctx.world.all_reduce(flags).tolist()
        if some and mb is None:
            mb = MicroBatch.of([], self.spec.engine.block_size, device=self.device)
        if mb is not None:
            mb.out_width = base + extra
            if self.step_together:  # one bucket for every replica, or every replica eager
                mb.step_rows = 0 if cannot else max(rows) // (lay.world_size // lay.dp)
        return bool(busy), mb

    def steps(self, mb) -> bool:
        """Whether micro-batch mb runs the decode step on this rank: as agreed over the DP
        replicas (step_rows), else when the step takes it; not before a fit of the fp8 scales
        (the first store fits them eagerly)."""
        if mb.step_rows is not None:
            return mb.step_rows > 0
        return self.decode_step is not None and not self.cache.pending and self.decode_step.takes(mb)

    @torch.no_grad()
    def copy_blocks(self, pairs: list[tuple[int, int]], drafter=None) -> None:
        """Copy cache blocks (source, destination) on this rank, in every layer of its stage and
        in a drafter's own cache: a forked copy's partly filled prompt block (engine.batch.scheduler)."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.device)
        dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.device)
        caches = [self.cache] + [c for c in (getattr(drafter, "cache", None),) if isinstance(c, KVCache)]
        for cache in caches:
            for t in cache.tensors():  # each [blocks, ...], quantized ones' scales too
                t.index_copy_(0, dst, t.index_select(0, src))

    @torch.no_grad()
    def compact(self, table: list[int], start: int, path: list[int]) -> None:
        """A tree verify's kept path into contiguous slots after `start`, in every layer of this
        rank's stage (engine.sample.tree.compact)."""
        compact(self.cache, table, start, path, self.spec.engine.block_size)

    def start_run(self) -> None:
        self.stats = {"busy_s": 0.0, "ticks": 0, "worked": 0, "two_batch": 0, "started": time.perf_counter()}
        self._eager_decode_s: list[float] = []  # eager decode steps' seconds, for engine.step.policy

    def end_run(self) -> None:
        """Waits for the last activations sent. Stats: ticks, worked (ticks this stage computed
        in), busy_s (time computing, not waiting for activations or tokens), wall_s, busy."""
        self._wait_send()
        st = self.stats
        st["wall_s"] = time.perf_counter() - st.pop("started")
        st["busy"] = st["busy_s"] / st["wall_s"] if st["wall_s"] else 0.0
        if self.ctx.rank == 0:
                step_policy.save_run(self, self._eager_decode_s)

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
            stepped = self.steps(mb)  # padded to a bucket, compiled or captured
            self.last_graphed = stepped
            self.graphed_steps += stepped
            # --enable-two-batch-overlap: two micro-batches, each one's exchanges under the other's work
            split = self.two_batch is not None and self.two_batch.takes(mb, eligible=not stepped
                                                                        and not self.cache.pending)
            meta, ids, tokens = (None, None, mb.tokens) if stepped else \
                (None, mb.ids if ctx.is_first_stage else None, mb.tokens) if split else self._view(mb)
            if ctx.is_first_stage:
                x = None if stepped else ids  # the decode step reads the ids from the chunks
            else:
                x = ctx.pp.recv((tokens, self.config.hidden_size), self.dtype, src=stage - 1, device=self.device)
            if ctx.rank == self.sampler_rank and ctx.is_last_stage:
                mb.start_masks(self.grammars, self._masks_pool)  # the grammars' masks fill while this stage computes
            t0 = time.perf_counter()
            self.stats["worked"] += 1
            if self.packer is not None and mb.is_decode:
                self.packer.observe(mb.tokens)
            if stepped:
                out = self.decode_step(x, mb)
            elif split:
                out = self.two_batch(None if ctx.is_first_stage else x, mb, self.cache)
                self.stats["two_batch"] += 1
            else:
                out = self.model(x, meta, self.cache)
                if mb.is_decode:
                    self._eager_decode_s.append(time.perf_counter() - t0)
            if not ctx.is_last_stage:
                self._wait_send()
                self._sending = ctx.pp.isend(out, dst=stage + 1)
            elif ctx.rank == self.sampler_rank and mb.chunks:
                out = mb.sample(out)  # each sampler reads its rows in float32
            if self.kv_tiers is not None and mb.tier_saves:
                self.kv_tiers.save(mb.tier_saves)  # this stage's layers of the blocks it filled
            self.stats["busy_s"] += time.perf_counter() - t0
        done = inflight[pp - 1] if len(inflight) == pp else None
        if done is None:
            return None
        seqs = len(done.chunks)
        self.logprobs = self._logprobs(done, seqs)
        self.prompt_logprobs = self._prompt_logprobs(done)
        # [seqs] tokens; with speculation [seqs, 1 + K] (engine.sample.verify), or wider where a
        # request draws for its copies: every replica the same width
        width = self.out_width(done)
        shape = (seqs,) if width == 1 and self.spec_k is None else (seqs, width)
        if ctx.rank == self.sampler_rank and seqs and tuple(out.shape) != shape:
            out = _widen(out, shape)
        if ctx.layout.dp == 1:
            tokens = out if ctx.rank == self.sampler_rank else torch.empty(shape, dtype=torch.long, device=self.device)
            return ctx.world.broadcast(tokens, src=self.sampler_rank)
        # each DP replica samples its own sequences; one all_reduce hands every rank its row
        table = torch.zeros(ctx.layout.dp, self.spec.engine.max_num_seqs, *shape[1:], dtype=torch.long,
                            device=self.device)
        if ctx.rank == self.sampler_rank and seqs:
            table[ctx.coords.dp, :seqs] = out
        return ctx.world.all_reduce(table)[ctx.coords.dp, :seqs]

    def _masks_pool(self) -> ThreadPoolExecutor | None:
        """The thread that fills grammar masks, made for the first micro-batch that has any;
        None where the forward leaves no core free (a CPU rank whose torch threads take every
        core): there the masks are filled after the forward. Measured on a 2-core host, SmolLM2
        at batch 16: beside the forward 0.91-0.94x the tokens/s without a grammar, after it
        (1.7 ms a step) within a few percent."""
        if self.device.type == "cpu" and torch.get_num_threads() >= len(os.sched_getaffinity(0)):
            return None
        if self._mask_pool is None:
            self._mask_pool = ThreadPoolExecutor(1, thread_name_prefix="atoll-masks")
        return self._mask_pool

    def _view(self, mb):
        """(metadata, token ids, token count) of the micro-batch as this rank computes it: all of
        it, or under context parallelism its cp rank's share (layers.context_parallel)."""
        if self.ctx.layout.cp == 1:
            return mb.meta, (mb.ids if self.ctx.is_first_stage else None), mb.tokens
        shards = CpShards.build(mb.meta, [c.seq.blocks for c in mb.chunks], group=self.ctx.cp,
                                scratch=self.num_blocks, device=self.device)
        ids = mb.ids[shards.own] if self.ctx.is_first_stage else None
        return shards, ids, len(shards.own)

    def _logprobs(self, done, seqs: int) -> torch.Tensor | None:
        """The logprob rows of a micro-batch leaving the pipeline (MicroBatch.sample), on its
        replica's leader (tp rank 0 of the first stage, which reports its tokens): sent down
        the tp-rank-0 pipeline group from the sampler, when a chunk asked for them."""
        ctx = self.ctx
        k = done.logprobs_k
        if k is None or ctx.coords.tp != 0 or ctx.coords.cp != 0:
            return None
        if ctx.layout.pp == 1:
            return done.logprobs  # this rank sampled them
        rows = done.logprobs if ctx.is_last_stage else torch.empty(seqs, done.draws + 2 * k, dtype=torch.float64,
                                                                    device=self.device)
        return ctx.pp.broadcast(rows, src=ctx.layout.pp - 1)

    def _prompt_logprobs(self, done) -> torch.Tensor | None:
        """The prompt-logprob rows of a micro-batch leaving the pipeline, on its replica's
        leader, as _logprobs hands them: [prompt rows, 2 + 2k] (engine.sample.sampler)."""
        ctx = self.ctx
        k = done.prompt_logprobs_k
        if k is None or ctx.coords.tp != 0 or ctx.coords.cp != 0:
            return None
        if ctx.layout.pp == 1:
            return done.prompt_logprobs
        rows = done.prompt_logprobs if ctx.is_last_stage else torch.empty(done.prompt_rows, 2 + 2 * k,
                                                                          dtype=torch.float64, device=self.device)
        return ctx.pp.broadcast(rows, src=ctx.layout.pp - 1)

    def _wait_send(self) -> None:
        if self._sending is not None:
            self._sending.wait()
            self._sending = None


def _widen(tokens: torch.Tensor, shape: tuple) -> torch.Tensor:
    """[seqs] or [seqs, w] sampled tokens as `shape`, -1 padded (a step that verified no draft,
    or shorter drafts than K)."""
    out = torch.full(shape, -1, dtype=torch.long, device=tokens.device)
    if tokens.dim() == 1:
        out[:, 0] = tokens
    else:
        out[:, :tokens.shape[1]] = tokens
    return out
