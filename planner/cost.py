"""Per-step cost of a layout: roofline GEMMs and attention, TP all-reduce, MoE all-to-all,
pipeline hand-offs; each time charged to the resource that binds it.

Decode reads every weight a step touches and the KV cache it attends to, so it is bound by
HBM bandwidth until the batch is large; prefill is bound by tensor-core FLOPs. Every op is
max(bytes / HBM bandwidth, FLOPs / peak) with the efficiencies of efficiency.py; the
communication of each layer is serial with its compute (no overlap assumed). A decode step may
carry prompt chunks beside its decode tokens (chunked prefill): the weights are read once for
both, the prompt tokens add their GEMM FLOPs, their causal attention and their share of the
collectives (planner/serving.py turns such steps into steady-state TPOT and TTFT). Each
decode step also pays a fixed floor per kernel it launches (efficiency.py: counted in atoll's
own decode path).

`decode` costs one step; `step_times` and `decode_many` cost many at once, batches and chunk
counts given as arrays (parts.py: the same arithmetic, the same numbers to the last bit), as
the search does for a layout's whole table of steps (steps.py). A decoder layer of one kind is
costed once per pass and charged to every stage that holds such layers.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from atoll.planner import efficiency as eff
from atoll.planner.categories import EXPERTS, KERNELS, KV, OVERHEAD, WEIGHTS
from atoll.planner.collectives import GroupLinks, all_gather, all_reduce, all_to_all, send_recv
from atoll.planner.context import partial_bytes_per_token, query_bytes_per_token
from atoll.planner import two_batch
from atoll.planner.moe_cost import moe_layer, sub_links
from atoll.planner.parts import Many, Parts, is_many, parts_for, vceil, vmax, vmin
from atoll.planner.runtime_terms import Measured
from atoll.planner.shapes import Shapes, stage_split

PIPELINE_WAIT = "pipeline: waiting for the slowest stage"
MTP_DRAFT = "speculative drafting (MTP layer)"


def layer_kernels(config, dense: bool) -> int:
    """Kernels one decoder layer launches in a decode step (efficiency.py: counted in atoll's
    own decode path), collectives apart."""
    k = eff.KERNELS_NORMS
    k += eff.KERNELS_MLA_ATTENTION if config.is_mla else eff.KERNELS_GQA_ATTENTION
    if not config.is_mla and config.qk_norm:
        k += eff.KERNELS_QK_NORM
    if dense:
        return k + eff.KERNELS_DENSE_MLP
    k += eff.KERNELS_MOE + (eff.KERNELS_ROUTER_GROUPED if config.n_group > 1 or config.scoring == "sigmoid"
                            else eff.KERNELS_ROUTER)
    if config.shared_expert_intermediate_size:
        k += eff.KERNELS_SHARED_EXPERT + (eff.KERNELS_SHARED_GATE if config.model_type == "qwen2_moe" else 0)
    return k


class CostModel:
    def __init__(self, config, shapes: Shapes, topology, workload, layout, placement, *, ranks: int | None = None):
        """ranks: ranks busy on one node (default the layout's, at most the node's GPUs); on a
        calibrated CPU machine ranks beyond its cores share them (runtime_terms.py)."""
        self.c, self.s, self.t, self.w, self.l = config, shapes, topology, workload, layout
        gpu = topology.gpu
        self.hbm = gpu.hbm_tb_s * 1e12 * eff.HBM_EFFICIENCY
        self.gemm_hbm = gpu.hbm_tb_s * 1e12 * eff.GEMM_READ_EFFICIENCY  # weights streamed through a GEMM
        self.flops = gpu.tflops(workload.dtype) * 1e12 * eff.gemm_efficiency(workload.dtype)
        self.attn_flops = gpu.bf16_tflops * 1e12 * eff.ATTENTION_EFFICIENCY
        self.cal = topology.calibration  # measured figures of this machine: they replace the above
        # atoll's own runtime as calibrated on a CPU: its overheads, MoE exchange and tick exchange
        self.runtime = self.cal is not None and self.cal.device == "cpu" and bool(self.cal.overhead_us)
        if self.cal is not None:
            self.measured = Measured(self.cal, workload, min(ranks or layout.world_size, topology.num_gpus))
            self.hbm = self.measured.bandwidth or self.hbm
            self.gemm_hbm = self.hbm  # calibrated: the measured GEMM rates by rows bound them instead
        # atoll's own runtime terms on a calibrated CPU are costed one step at a time
        self.vectorises = not self.runtime
        self.stages = stage_split(config, layout.pp)
        self.n_dense = [sum(1 for i in range(a, b) if shapes.dense_layers[i]) for a, b in self.stages]
        tp, st = layout.tp, layout.stage_size
        self.cp = layout.cp  # ranks sharing each sequence (context.py); 1 without cp
        self.g_tp = GroupLinks.of(list(range(tp)), placement, topology)
        # the stage's tp x dp ranks (one cp rank's share of the stage): the MoE layers' grid
        self.g_stage = GroupLinks.of(list(range(tp * layout.dp)), placement, topology)
        self.g_cp = GroupLinks.of([j * tp for j in range(self.cp)], placement, topology)  # tp innermost, then cp
        self._placement = placement
        self.g_pp = [GroupLinks.of(list(range(s * st, s * st + tp)) + list(range((s + 1) * st, (s + 1) * st + tp)),
                                   placement, topology) for s in range(layout.pp - 1)]
        self._sub: dict[tuple[int, int], GroupLinks] = {}

    @functools.cached_property
    def g_world(self) -> GroupLinks:
        """Every rank of the replica (the runtime's token exchange)."""
        return GroupLinks.of(list(range(self.l.world_size)), self._placement, self.t)

    # -- helpers ---------------------------------------------------------------------------
    def _op(self, out, nbytes, flops, mem_kind: str, peak: float | None = None, rows=None, when=True):
        """rows: the GEMM's rows (tokens), for a calibrated rate at that size."""
        rate = peak or self.flops
        if self.cal is not None and rows is not None:
            measured = self.measured.gemm(rows)
            if measured is not None:
                rate = np.where(measured != 0, measured, rate) if is_many(measured) else measured or rate
        out.add_op(mem_kind, nbytes / (self.gemm_hbm if mem_kind in (WEIGHTS, EXPERTS) else self.hbm),
                   flops / rate, when)

    def _comm_name(self, what: str, g: GroupLinks) -> str:
        return f"{what} over {g.kind}"

    def links(self, size: int, stride: int) -> GroupLinks:
        """The links of a group of `size` ranks of a stage, `stride` apart (moe_cost.sub_links)."""
        if (size, stride) not in self._sub:
            self._sub[(size, stride)] = sub_links(self.g_stage, size, stride)
        return self._sub[(size, stride)]

    # -- one decoder layer and one pipeline stage ------------------------------------------
    def layer(self, dense: bool, **kw):
        """Seconds per category of one decoder layer (dense or MoE) in one pass; the arguments
        are stage()'s. With two-batch overlap an MoE layer's pass is also costed as two halves,
        taken where it is faster (planner/two_batch.py)."""
        one, room = self._layer(dense, **kw)
        if not dense and self.w.two_batch_overlap and self.l.ep > 1 and not self.runtime:
            two_batch.apply(one, room, self._layer(dense, **two_batch.halves(kw)), kw["seqs_per_dp"],
                            two_batch.most_gain(kw["prefill"]))
        return one

    def _layer(self, dense: bool, *, seqs_per_dp, active_dp, new_tokens: int, ctx: float, prefill: bool,
               prompt_tokens=0.0, prompt_rows=0.0, chunk_ctx=None):
        """layer() as one batch -> (seconds per category, (the seconds of its ep exchange, the
        most of them its other work can hide: planner/two_batch.py))."""
        s, l, w = self.s, self.l, self.w
        wb, h, tp, cp = w.weight_bytes, s.hidden, l.tp, self.cp
        # with cp (context.py) a prompt's tokens are split over the cp ranks; decode tokens are not
        per_seq = new_tokens / cp if prefill and cp > 1 else new_tokens
        chunks = prompt_tokens  # the step's chunk tokens on all cp ranks
        if cp > 1:
            prompt_tokens, prompt_rows = prompt_tokens / cp, prompt_rows / cp
        n = seqs_per_dp * per_seq + prompt_tokens  # tokens on one DP rank
        n_all = seqs_per_dp * per_seq * active_dp + prompt_rows  # tokens entering the MoE layers of the stage
        act = n * h * w.act_bytes  # activations of one DP rank, bytes
        attn_w = s.attn_sharded / tp + s.attn_replicated
        one = parts_for(seqs_per_dp, prompt_tokens, prompt_rows)
        self._op(one, attn_w * wb, 2 * n * attn_w, WEIGHTS, rows=n)
        if prefill:  # causal attention core: half of the n x ctx score matrix, QK and PV (1/cp of it here)
            core = 2 * 2 * seqs_per_dp * per_seq * ctx / 2 * (s.heads / tp) * s.head_dim
            self._op(one, 0.0, core, KV, peak=self.attn_flops if self.cal is None else None, rows=per_seq)
            if cp > 1:
                self._cp_prefill(one, seqs_per_dp * new_tokens)
        else:  # every sequence reads its cache: [ctx, kv] per rank (1/cp of each sequence's)
            kv_tok = s.kv_bytes_per_token_layer(tp, w.kv_bytes, w.kv_scale_bytes)
            core = 4 * seqs_per_dp * new_tokens * ctx / cp * (s.heads / tp) * s.attn_dim
            self._op(one, seqs_per_dp * ctx / cp * kv_tok, core, KV, rows=seqs_per_dp, when=seqs_per_dp != 0)
            if cp > 1:  # every rank's partials of every token: one all-gather over the cp group
                parts = seqs_per_dp * new_tokens * cp * partial_bytes_per_token(s, tp)
                one.add(self._comm_name("CP exchange", self.g_cp), all_gather(parts, self.g_cp),
                        when=seqs_per_dp != 0)
        # the chunks' causal attention: each token over half its prompt (chunk_ctx: the positions
        # a chunk token attends to on average, where the step's real chunks are known)
        attended = w.isl / 2 if chunk_ctx is None else chunk_ctx
        core = 2 * 2 * prompt_tokens * attended * (s.heads / tp) * s.head_dim
        self._op(one, 0.0, core, KV, peak=self.attn_flops if self.cal is None else None, rows=prompt_tokens,
                 when=prompt_tokens != 0)
        if cp > 1:
            self._cp_prefill(one, chunks, when=prompt_tokens != 0)
        tp_all_reduce = self._comm_name("TP all-reduce", self.g_tp)
        one.add(tp_all_reduce, all_reduce(act, self.g_tp))
        moved = 0.0  # seconds of the ep exchange (two-batch overlap can hide them)
        if dense:
            mlp = s.dense_mlp / tp
            self._op(one, mlp * wb, 2 * n * mlp, WEIGHTS, rows=n)
            one.add(tp_all_reduce, all_reduce(act, self.g_tp))
        elif self.runtime:  # atoll's own exchange, as the runtime picks it (layers/moe.py)
            self.measured.moe(self, one, n=n, n_all=n_all, wb=wb)
        else:
            moved = moe_layer(self, one, n=n, n_all=n_all, act=act, wb=wb, prefill=prefill)
        room = (moved, vmin(moved, one.total() - moved))  # hidden at most under the work so far (floors aside)
        if self.runtime:
            one[OVERHEAD] += self.measured.layer_overhead(dense, seqs_per_dp)
        elif not prefill:  # a prefill-only pass is costed as prefill: no floors
            one.add(KERNELS, layer_kernels(self.c, dense) * eff.KERNEL_OVERHEAD_S, when=seqs_per_dp != 0)
        return one, room

    def _cp_prefill(self, out, tokens, when=True) -> None:
        """One layer's cp exchange for `tokens` prompt tokens of a step (all cp ranks'): their
        queries all-gathered, then each rank's partials of every token all-to-all (context.py)."""
        s, g = self.s, self.g_cp
        t = all_gather(tokens * query_bytes_per_token(s, self.l.tp, self.w.act_bytes), g)
        t = t + all_to_all(tokens * partial_bytes_per_token(s, self.l.tp), g)
        out.add(self._comm_name("CP exchange", g), t, when=when)

    def stage(self, stage: int, *, seqs_per_dp, active_dp, new_tokens: int, ctx: float, prefill: bool,
              prompt_tokens=0.0, prompt_rows=0.0, chunk_ctx=None, layers: dict | None = None):
        """Seconds per category for one pass of a micro-batch through `stage`.
        seqs_per_dp: sequences on each active DP rank; new_tokens: tokens per sequence this pass
        (1 in decode, the prompt in prefill); ctx: tokens each sequence attends to.
        prompt_tokens: prompt-chunk tokens mixed into a decode pass on the busiest DP rank, each
        attending to half the prompt on average; prompt_rows: such tokens over the whole stage.
        chunk_ctx: positions a chunk token attends to on average (default half the workload's isl).
        layers: the pass's layers by kind, costed once and shared by every stage of the pass.
        Numbers give a dict (parts.Parts); arrays of sequences or prompt tokens a parts.Many."""
        s, l, w = self.s, self.l, self.w
        kw = dict(seqs_per_dp=seqs_per_dp, active_dp=active_dp, new_tokens=new_tokens, ctx=ctx,
                  prefill=prefill, prompt_tokens=prompt_tokens, prompt_rows=prompt_rows, chunk_ctx=chunk_ctx)
        layers = {} if layers is None else layers
        out = parts_for(seqs_per_dp, prompt_tokens, prompt_rows)
        start, end = self.stages[stage]
        n_dense = self.n_dense[stage]
        for dense, count in ((True, n_dense), (False, end - start - n_dense)):
            if count:
                if dense not in layers:
                    layers[dense] = self.layer(dense, **kw)
                out.merge(layers[dense], count)  # the stage's `count` layers of this kind
        tp = l.tp
        cp = self.cp  # a prompt's tokens are split over the cp ranks
        act = ((seqs_per_dp * (new_tokens / cp if prefill else new_tokens) + prompt_tokens / cp) if cp > 1
               else (seqs_per_dp * new_tokens + prompt_tokens)) * s.hidden * w.act_bytes
        if stage == 0 and tp > 1:  # the vocab-parallel embedding sums its rows over tp
            out.add(self._comm_name("TP all-reduce", self.g_tp), all_reduce(act, self.g_tp))
        if stage == l.pp - 1:  # LM head (bf16 under fp8 weights), logits of the last token of each sequence
            head = s.head / tp
            # (a speculative verify step takes the logits of every token it checks)
            rows = vmax(seqs_per_dp * (1 if prefill else new_tokens), 1)
            self._op(out, head * w.embed_bytes, 2 * rows * head, WEIGHTS, rows=rows)
            # each rank's vocab shard of the logits gathered over tp (layers.embedding.ParallelLMHead)
            logits = rows * s.vocab * w.act_bytes
            out.add(self._comm_name("TP all-gather", self.g_tp), all_gather(logits, self.g_tp))
            if cp > 1:  # a prefill step's hidden rows gathered over cp for the head (context.py)
                tokens = seqs_per_dp * new_tokens if prefill else prompt_tokens
                out.add(self._comm_name("CP exchange", self.g_cp),
                        all_gather(tokens * s.hidden * w.act_bytes, self.g_cp), when=prefill or prompt_tokens != 0)
        if self.runtime:  # every rank runs each tick's scheduling, metadata and sampling
            out[OVERHEAD] += self.measured.tick_overhead(seqs_per_dp)
        elif not prefill and stage == 0:
            out.add(KERNELS, eff.KERNELS_PER_STEP * eff.KERNEL_OVERHEAD_S, when=seqs_per_dp != 0)
        return out

    def handoff(self, stage: int, nbytes) -> tuple[str, float]:
        g = self.g_pp[stage]
        return f"PP send/recv over {g.kind}", send_recv(nbytes, self.l.tp * self.cp, g)

    # -- whole steps -----------------------------------------------------------------------
    def _through_stages(self, parts: list, handoff_bytes):
        """Breakdown of one pass through every stage: each stage's parts summed by name, plus
        the activations handed from each stage to the next."""
        total = Many(parts[0].size) if isinstance(parts[0], Many) else Parts()
        for p in parts:
            total.merge(p)
        for i in range(self.l.pp - 1):
            total.add(*self.handoff(i, handoff_bytes))
        return total

    def _passes(self, kw: dict) -> list:
        """Every stage's part of one pass (stage()'s arguments `kw`); stages alike (as many
        layers of each kind, neither first nor last) share one, costed once, except where the
        runtime's terms are added to each afterwards."""
        layers: dict = {}
        alike: dict = {}
        out = []
        for i, (a, b) in enumerate(self.stages):
            key = (self.n_dense[i], b - a, i == 0, i == self.l.pp - 1) if not self.runtime else i
            if key not in alike:
                alike[key] = self.stage(i, layers=layers, **kw)
            out.append(alike[key])
        return out

    def _decode(self, batch, prompts, prompt_len):
        """(step seconds, breakdown, micro-batches) for a batch and chunk count, or arrays of them."""
        l, w = self.l, self.w
        micro = vmax(1, vmin(batch, l.pp))
        m = vceil(batch / micro)
        per_dp = vceil(m / l.dp)
        active = vmin(l.dp, m)
        ctx = w.mean_decode_context
        lane = prompts / micro  # chunks in each micro-batch
        # a chunk is one DP rank's (each rank schedules its own requests): the busiest rank holds
        # ceil(chunks / dp) of them, and every rank waits for it at each MoE layer's exchange
        busiest = (vceil(lane / l.dp) if l.dp > 1 else lane) * prompt_len
        verify = 1 + w.spec_tokens  # tokens of a sequence a step checks (1: no speculation)
        parts = self._passes(dict(seqs_per_dp=per_dp, active_dp=active, new_tokens=verify, ctx=ctx, prefill=False,
                                  prompt_tokens=busiest, prompt_rows=lane * prompt_len))
        if self.runtime:  # the sampled tokens reach every rank each tick (engine.rank.runner.tick)
            for p in parts:
                for k, v in self.measured.tick_exchange(self, per_dp).items():
                    p[k] += v
        # every cp rank hands on the whole decode batch and its share of the chunks' tokens
        total = self._through_stages(parts, (per_dp * active * verify * self.cp + lane * prompt_len)
                                     * self.s.hidden * w.act_bytes)
        if w.spec_tokens and w.spec_method == "mtp":
            total.add(MTP_DRAFT, w.spec_tokens * self._mtp_draft(per_dp, active, ctx), when=per_dp != 0)
        chain = total.total()
        if l.pp == 1:
            slowest = chain  # the one stage is the whole pass
        else:
            sums = {id(p): p.total() for p in parts}
            slowest = functools.reduce(vmax, [sums[id(p)] for p in parts])
        tpot = vmax(chain, micro * slowest)
        total.add(PIPELINE_WAIT, tpot - chain, when=tpot > chain)
        return tpot, total, micro

    def _mtp_draft(self, per_dp, active, ctx):
        """Seconds of one drafted token of every sequence by the checkpoint's next-token layer
        (DeepSeek-V3's MTP module): one decoder layer of the model's kind (an MoE one where the
        model has them) and the LM head, on the last stage."""
        moe = any(not d for d in self.s.dense_layers)
        one = self.layer(not moe, seqs_per_dp=per_dp, active_dp=active, new_tokens=1, ctx=ctx, prefill=False)
        head = self.s.head / self.l.tp
        rows = vmax(per_dp, 1)
        self._op(one, head * self.w.embed_bytes, 2 * rows * head, WEIGHTS, rows=rows)
        return one.total()

    def decode(self, batch: int, prompts: float = 0.0, prompt_len: float = 0.0) -> tuple[float, dict[str, float], int]:
        """(step seconds, breakdown, micro-batches) of one decode step of `batch` sequences on
        this replica; with `prompts` prompt chunks of `prompt_len` tokens mixed in (chunked
        prefill), spread over the micro-batches and DP ranks. `batch` 0 with prompts: a step
        that only prefills."""
        tpot, total, micro = self._decode(batch, prompts, prompt_len)
        return tpot, dict(total), micro

    def step_times(self, batches, prompts, prompt_len: float) -> np.ndarray:
        """decode(b, k, prompt_len)[0] for every pair of the arrays `batches` and `prompts`."""
        b, k = _arrays(batches, prompts)
        if not self.vectorises:  # (nothing to step, (0, 0), is never asked for)
            return np.array([self.decode(int(x), float(y), prompt_len)[0] if x or y else np.nan for x, y in zip(b, k)])
        with np.errstate(divide="ignore", invalid="ignore"):  # a step of nothing (0, 0) is never asked for
            return self._decode(b, k, prompt_len)[0]

    def decode_many(self, batches, prompts, prompt_len: float) -> list[dict[str, float]]:
        """decode(b, k, prompt_len)[1], the breakdown, for every pair of the arrays."""
        b, k = _arrays(batches, prompts)
        if not self.vectorises:
            return [self.decode(int(x), float(y), prompt_len)[1] for x, y in zip(b, k)]
        with np.errstate(divide="ignore", invalid="ignore"):
            total = self._decode(b, k, prompt_len)[1]
        return total.singles()

    def micro_batch(self, rows: int, chunk_tokens: int, *, ctx: float, chunk_ctx: float,
                    dp_rows: int | None = None, dp_chunk_tokens: int | None = None) -> tuple[float, float, dict]:
        """One micro-batch's pass through every stage, as the simulator's engines run it
        (planner/sim): `rows` decoding sequences attending to `ctx` positions on average, and
        `chunk_tokens` prompt-chunk tokens attending to `chunk_ctx` on average. With DP the
        busiest DP rank's share is given (dp_rows, dp_chunk_tokens; default an even split).
        Returns (the pass's seconds, its slowest stage's, the breakdown)."""
        l = self.l
        per_dp = dp_rows if dp_rows is not None else -(-rows // l.dp)
        busiest = dp_chunk_tokens if dp_chunk_tokens is not None else chunk_tokens / l.dp
        parts = self._passes(dict(seqs_per_dp=per_dp, active_dp=max(1, min(l.dp, rows)), new_tokens=1, ctx=ctx,
                                  prefill=False, prompt_tokens=busiest, prompt_rows=chunk_tokens, chunk_ctx=chunk_ctx))
        if self.runtime:
            for p in parts:
                for k, v in self.measured.tick_exchange(self, per_dp).items():
                    p[k] += v
        total = self._through_stages(parts, (rows * self.cp + chunk_tokens) * self.s.hidden * self.w.act_bytes)
        slowest = max(p.total() for p in {id(p): p for p in parts}.values())
        return total.total(), slowest, dict(total)

    def prefill(self, requests: int) -> tuple[float, float, dict[str, float]]:
        """(time for one request to pass all stages, bottleneck-stage time per `requests`
        requests, breakdown of the one-request pass)."""
        l, w = self.l, self.w
        layers: dict = {}
        one = [self.stage(i, seqs_per_dp=1, active_dp=1, new_tokens=w.isl, ctx=w.isl, prefill=True, layers=layers)
               for i in range(l.pp)]
        total = self._through_stages(one, w.isl * self.s.hidden * w.act_bytes)
        per_dp = math.ceil(requests / l.dp)
        active = min(l.dp, requests)
        if (per_dp, active) != (1, 1):
            layers = {}
            many = [self.stage(i, seqs_per_dp=per_dp, active_dp=active, new_tokens=w.isl, ctx=w.isl, prefill=True,
                               layers=layers) for i in range(l.pp)]
        else:
            many = one  # the same passes
        return sum(total.values()), max(sum(p.values()) for p in many), dict(total)

    def prefill_burst(self, batch: int) -> float:
        """Median time to first token when `batch` prompts arrive together, as the bench runs
        them: each of the pp lanes (micro-batches) prefills its share in one chunk, entering
        one tick after the previous; the median request waits for half of the later lanes."""
        l, w = self.l, self.w
        micro = min(batch, l.pp)
        per_dp = math.ceil(math.ceil(batch / micro) / l.dp)
        active = min(l.dp, math.ceil(batch / micro))
        layers: dict = {}
        parts = [self.stage(i, seqs_per_dp=per_dp, active_dp=active, new_tokens=w.isl, ctx=w.isl, prefill=True,
                            layers=layers) for i in range(l.pp)]
        through = sum(self._through_stages(parts, per_dp * active * w.isl * self.s.hidden * w.act_bytes).values())
        return through + (micro - 1) / 2 * max(sum(p.values()) for p in parts)


def _arrays(batches, prompts) -> tuple[np.ndarray, np.ndarray]:
    b = np.asarray(batches, dtype=float).ravel()
    k = np.broadcast_to(np.asarray(prompts, dtype=float), b.shape).copy()
    return b, k
