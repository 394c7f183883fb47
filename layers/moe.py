"""The MoE block: a replicated router, routed experts sharded over ep (and each expert over
moe_tp), tokens moved by the Dispatcher, optional shared experts over tp.

One pipeline stage's tp*dp ranks are the MoE's ep x moe_tp grid. When tp == moe_tp, ep rank
e is DP rank e and its own tokens are its share ("direct": DP4EP4, TP2 with pure TP
experts). Otherwise (TP4EP4: tokens replicated over tp) the stage's tokens are gathered over
dp, split evenly into ep chunks, each chunk routed by its ep rank, and the results gathered
back over ep.

Dispatch: island-first (the Dispatcher's hierarchical path, on the context's rail and
ep_island subgroups) when the ep group spans more than one island, flat inside one;
the run's config (the `engine` a model passes its MoE layers) may force "flat" or "hierarchical" (dispatch), and its
moe_capacity_factor caps each expert's rows (None: dropless). Keywords given to SparseMoE win over engine's.

Exchange. Decode-sized steps skip the all_to_all for comm.exchange.gather_combine, whose
shapes are fixed (the all_to_all reads split sizes on the host): each ep rank runs its
experts on every row of the ep group and the partial sums are added (see there). Direct:
the rows are gathered over ep (every rank padded to the largest count, which eager mode
reads with row_counts) and reduce-scattered back. Otherwise the stage's tokens are already
on every ep rank after the dp gather (with dp 1 there is none): replicated, one all_reduce.
exchange="auto" takes it when the rows per ep rank are at most moe_gather_rows (config/engine.py
says how its default was measured) and the
dispatch is flat and dropless: capacity drops need the all_to_all's counts, and where the ep
group spans islands the island-first all_to_all sends each token across once, not to every
rank. "gather" / "alltoall" force one (gather stays exact with hierarchical; it refuses a
capacity_factor). The default is the config's moe_exchange.

static (inside `with moe.static_exchange():`, which the CUDA-graph decode step enters): never
read a device value on the host, so always gather_combine and no count exchange; every DP
rank of the stage must pass the same row count (the step pads them to one bucket).

Experts, slots and load. The router picks logical experts; the layer holds physical slots:
one per expert in contiguous blocks, or with --enable-eplb E + R slots whose experts a
rebalance chooses (comm/eplb.py), each pair routed to one copy of its expert
(layers/expert_map.py). Dispatch and exchange move slot ids as they moved expert ids. Each
layer counts the pairs routed to each slot (ExpertLoad) once over the engine: direct, every
ep rank its own rows; otherwise every ep rank routes the stage's rows (or its chunk of them)
and counts its tensor_split chunk only; tp ranks of one ep rank count the same rows, and the
window (engine/rank/eplb.py) sums over the ep group alone. A static step's padding rows are
not counted: the step says which rows are real (static_exchange(real=...)).

Overlap. forward_steps / routed_steps are the layer as an overlapped step (comm/pending.py):
they yield while the dispatch, the combine or the gather exchange fly, which two-batch overlap
(engine/step/two_batch.py) fills with the other micro-batch's work; forward drives them at once.
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

import torch
import torch.nn.functional as F
from torch import nn

from atoll.comm.dispatch import Dispatcher
from atoll.comm.eplb import Placement
from atoll.comm.exchange import gather_combine, gather_combine_steps
from atoll.comm.gather import all_gather_rows, row_counts
from atoll.comm.group import Group
from atoll.comm.pending import ready, run
from atoll.config import MOE_EXCHANGES, EngineConfig
from atoll.errors import ConfigError
from atoll.kernels import fused_moe
from atoll.kernels.fp8_moe import fused_moe_fp8
from atoll.kernels.backend import fp8_dot_supported, use_triton
from atoll.layers import fp8_linear
from atoll.layers.expert_map import ExpertLoad, ExpertMap
from atoll.layers.linear import _param, copy_into, divide
from atoll.layers.router import Router


class Experts(nn.Module):
    """This rank's routed expert slots, a contiguous block `local` of the physical slot ids,
    slot j holding logical expert `logical[j]` (default: the slot ids themselves, the
    contiguous blocks without EPLB; with it a hot expert may fill several slots, on several
    ranks: comm/eplb.py), each sharded over moe_tp along the intermediate dim. w13:
    [slots_local, 2*inter/moe_tp, hidden] with gate rows then up rows; w2: [slots_local,
    hidden, inter/moe_tp]. Outputs are partial sums over moe_tp."""

    def __init__(self, local: range, hidden: int, inter: int, group: Group, *, dtype=None, logical=None):
        super().__init__()
        self.local, self.group = local, group
        self.logical = list(local) if logical is None else list(logical)
        if len(self.logical) != len(local):
            raise ValueError(f"{len(local)} slots given {len(self.logical)} logical experts")
        self.inter_local = divide(inter, group.size, "moe_intermediate_size")
        self.w13 = _param(len(local), 2 * self.inter_local, hidden, dtype=dtype)
        self.w13.weight_loader = self._load_w13
        self.w2 = _param(len(local), hidden, self.inter_local, dtype=dtype)
        self.w2.weight_loader = self._load_w2
        # the checkpoint tensors each parameter is filled from (models/strict.py checks them all)
        held = sorted(set(self.logical))
        self.shard_ids = {"w13": tuple((e, part) for e in held for part in (0, 1)),
                          "w2": tuple((e, "down") for e in held)}
        self.fp8_scales: dict[str, fp8_linear.Fp8Scales] = {}  # w13 and w2 kept in fp8 (keep_fp8)

    def _load_w13(self, param, src, shard):
        e, part = shard
        slots = [j for j, held in enumerate(self.logical) if held == e]
        if not slots:
            return False  # another ep rank's expert: never read
        n, start = self.inter_local, self.group.rank * self.inter_local
        for j in slots:
            copy_into(param.data[j, part * n:(part + 1) * n], src[start:start + n], self.fp8_scales.get("w13"))

    def _load_w2(self, param, src, shard):
        e, _ = shard
        slots = [j for j, held in enumerate(self.logical) if held == e]
        if not slots:
            return False
        start = self.group.rank * self.inter_local
        for j in slots:
            copy_into(param.data[j], src[:, start:start + self.inter_local], self.fp8_scales.get("w2"))

    def slot_tensors(self) -> list[torch.Tensor]:
        """Every tensor with a row per local slot (the weights, and their scales when kept in
        fp8): what a rebalance moves between ranks (engine/rank/eplb.py)."""
        names = ["w13", "w2"] + [f"{n}_scale" for n in self.fp8_scales]
        return [t for t in (getattr(self, n, None) for n in names)
                if isinstance(t, torch.Tensor) and t.dim() and t.shape[0] == len(self.local)]

    def forward(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """rows: [n_recv, hidden] in any order, local_ids: [n_recv] each row's local expert ->
        [n_recv, hidden]; the routing weights are applied later, by combine."""
        ones = torch.ones(len(rows), 1, device=rows.device)
        return self._fused(rows, local_ids[:, None], ones)

    def _fused(self, rows: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """fused_moe over ids [n, k] (local experts); weights kept in fp8 (--quantization fp8)
        go to fused_moe_fp8 on the Triton path, multiplied in fp8 as held, and are dequantized
        for this call on the torch path (the CPU) and on GPUs without fp8 tensor cores (before
        compute capability 8.9)."""
        if fp8_linear.is_fp8(self.w13) and use_triton(rows, self.w13, self.w2) and fp8_dot_supported(rows):
            return fused_moe_fp8(rows, self.w13, self.w13_scale, self.w2, self.w2_scale, ids, weights)
        return fused_moe(rows, *self.weights(rows.dtype), ids, weights)

    def weights(self, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """(w13, w2) as floats to multiply by: as held, or dequantized for this call when kept
        in fp8 (models/quantize.py). Only the torch path (the CPU) calls it for fp8 weights;
        the Triton path multiplies them in fp8 (kernels/fp8_moe.py)."""
        if not fp8_linear.is_fp8(self.w13):
            return self.w13, self.w2
        return (fp8_linear.dequantized(self.w13, self.w13_scale, dtype),
                fp8_linear.dequantized(self.w2, self.w2_scale, dtype))

    def weighted(self, rows: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """rows: [n, hidden], local_ids: [n, k] (-1: not this rank's expert), weights: [n, k] ->
        [n, hidden], each row's weighted sum over its local experts, with shapes fixed by n.

        At decode sizes this reads weights, not FLOPs, so the path reading fewest bytes wins.
        Triton: fused_moe (fused_moe_fp8 for fp8 weights, read as held), whose buffers are sized by a bound (no host sync), reads only the
        experts that have a pair. Torch (the reference loops over ids.unique(), a host read):
        every row through every local expert, one GEMM over the stacked w13 and one bmm over
        w2, each local expert's weights read once. Gathering each (row, slot)'s expert weights
        (index_select + bmm) would read an expert once per pair, after index_select wrote the
        copy: ~3*n*k expert matrices against experts_local. n is ep x (1..32) gathered rows and
        experts_local is experts / ep (Qwen3-30B-A3B at EP4: 32 local, top-8), so n*k >=
        experts_local from one row per rank: the dense loop reads less.
        Measured once on an H200, bf16, that EP4 shape (hidden 2048, inter 768), CUDA graph
        replays at n = 4, 8, 16, 32, 64, 128: Triton 37, 55, 77, 91, 94, 99 us; dense 105 to
        166 us (32 experts' weights at 4.3 TB/s: 70 us)."""
        n, hidden = rows.shape
        local = len(self.local)
        if local == 0 or n == 0:
            return rows.new_zeros(n, hidden)
        if use_triton(rows, self.w13, self.w2):
            return self._fused(rows, local_ids, weights)
        w13, w2 = self.weights(rows.dtype)
        inter = self.inter_local
        experts = torch.arange(local, device=rows.device)
        coef = ((local_ids[:, :, None] == experts) * weights[:, :, None].float()).sum(1)  # [n, local] fp32
        h = F.linear(rows, w13.view(local * 2 * inter, hidden)).view(n, local, 2, inter)
        act = F.silu(h[:, :, 0]) * h[:, :, 1]  # [n, local, inter]
        y = torch.bmm(act.transpose(0, 1), w2.transpose(1, 2))  # [local, n, hidden]
        return torch.einsum("nl,lnh->nh", coef, y.float()).to(rows.dtype)


def make_dispatcher(ctx, num_experts: int, *, engine: EngineConfig | None = None, islands=None,
                    hierarchical: bool | None = None, capacity_factor: float | None = None,
                    grouped: bool = True) -> Dispatcher:
    """The Dispatcher over ctx.ep, island-first when its ep group spans islands (see above);
    `engine` the run's switches (dispatch, moe_capacity_factor; None: the defaults)."""
    engine = engine or EngineConfig()
    mode = engine.dispatch
    if capacity_factor is None:
        capacity_factor = engine.moe_capacity_factor
    subgroups = {}
    if islands is None and hasattr(ctx, "ep_islands"):
        islands = ctx.ep_islands
        subgroups = dict(island_group=ctx.ep_island, rail_group=ctx.ep_rail)
    spans = islands is not None and len(islands) > 1
    if hierarchical is None:
        if mode == "hierarchical" and not spans and ctx.ep.size > 1:
            raise ConfigError(f"dispatch=hierarchical: the ep group of ranks {list(ctx.ep.ranks)} lies in one "
                              "island; use --dispatch flat or auto, or a plan whose EP group spans islands")
        hierarchical = spans and mode != "flat"
    return Dispatcher(ctx.ep, num_experts, islands=islands, capacity_factor=capacity_factor,
                      hierarchical=hierarchical, grouped=grouped, **subgroups)


EXCHANGES = MOE_EXCHANGES


class SparseMoE(nn.Module):
    """Routed experts, plus optional shared experts: Qwen2-MoE's `shared_expert` scaled by
    sigmoid(shared_expert_gate(x)), or DeepSeek-V3's always-on `shared_experts`."""

    def __init__(self, *, hidden: int, inter: int, router: Router, ctx, dtype=None,
                 shared: nn.Module | None = None, shared_gate: nn.Module | None = None,
                 engine: EngineConfig | None = None, islands=None, hierarchical: bool | None = None,
                 capacity_factor: float | None = None, exchange: str | None = None):
        super().__init__()
        self.ctx = ctx
        self.shared_name = "shared_expert" if shared_gate is not None else "shared_experts"
        if shared is not None:
            setattr(self, self.shared_name, shared)  # named as in the checkpoint
        self.shared_expert_gate = shared_gate
        self.gate = router
        engine = engine or EngineConfig()
        # E logical experts on E + R physical slots (R redundant copies with --enable-eplb)
        redundant = engine.num_redundant_experts if engine.enable_eplb else 0
        self.placement = Placement.initial(router.num_experts, redundant, ctx.ep.size)
        # arrival order: the experts take each row's slot, so rows need no sort by slot
        self.dispatcher = make_dispatcher(ctx, self.placement.num_slots, engine=engine, islands=islands,
                                          hierarchical=hierarchical,
                                          capacity_factor=capacity_factor, grouped=False)
        self.experts = Experts(self.dispatcher.local_experts, hidden, inter, ctx.moe_tp, dtype=dtype,
                               logical=self.placement.local(ctx.ep.rank))
        self.expert_map = ExpertMap(self.placement) if engine.enable_eplb else None  # None: slot = expert
        self.expert_load = ExpertLoad(self.placement.num_slots)
        self.direct = ctx.layout.tp == ctx.layout.moe_tp
        self.exchange = engine.moe_exchange if exchange is None else exchange
        if self.exchange not in EXCHANGES:
            raise ConfigError(f"exchange={self.exchange!r} is not one of {', '.join(EXCHANGES)}")
        if self.exchange == "gather" and self.dispatcher.capacity_factor is not None:
            raise ConfigError(f"exchange=gather is dropless: capacity_factor={self.dispatcher.capacity_factor} "
                              "needs the all-to-all")
        self.gather_max_rows = engine.moe_gather_rows
        self.static = False  # inside static_exchange(): no host reads of device values
        self.real: torch.Tensor | None = None  # inside static_exchange(real=...): [rows] the step's real rows
        self.exchange_bytes: Counter = Counter()  # gather_combine's bytes sent, per link class

    @contextmanager
    def static_exchange(self, real: torch.Tensor | None = None):
        """Steps run inside take the fixed-shape exchange (see the module's docstring: static);
        real: [rows] bool, the rows of the step that are not padding (counted: layers/expert_map.py)."""
        before = self.static, self.real
        self.static, self.real = True, real
        try:
            yield self
        finally:
            self.static, self.real = before

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens of this DP rank, hidden], the same on its tp ranks -> same shape."""
        return self._shared(x, self._static(x) if self.static else run(self.routed_steps(x)))

    def forward_steps(self, x: torch.Tensor, overlap: bool = False):
        """forward as an overlapped step, eager only: yields while its exchanges fly (overlap=True)."""
        y = yield from self.routed_steps(x, overlap)
        return self._shared(x, y)

    def _shared(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """y, the routed experts' sum, plus the shared experts' output on x."""
        shared = getattr(self, self.shared_name, None)
        if shared is None:
            return y
        if self.shared_expert_gate is None:
            return y + shared(x)
        return y + torch.sigmoid(self.shared_expert_gate(x)) * shared(x)

    @property
    def may_gather(self) -> bool:
        """Whether any step may take gather_combine: forced, or auto with flat dropless dispatch."""
        d = self.dispatcher
        return self.exchange == "gather" or (self.exchange == "auto" and d.capacity_factor is None
                                             and not d.hierarchical)

    def gathers(self, rows_per_rank: int) -> bool:
        """Whether a step of rows_per_rank rows per ep rank takes gather_combine."""
        return self.may_gather and (self.exchange == "gather" or rows_per_rank <= self.gather_max_rows)

    def _static(self, x: torch.Tensor) -> torch.Tensor:
        """routed_steps inside static_exchange (a compiled or captured step): the fixed-shape
        exchange, every DP rank the same row count, no generator (a compiled trace holds it)."""
        ctx = self.ctx
        if self.exchange == "alltoall" or self.dispatcher.capacity_factor is not None:
            raise ConfigError("the compiled decode step needs the MoE gather exchange: it cannot run "
                              f"exchange={self.exchange} or capacity_factor={self.dispatcher.capacity_factor}")
        if self.direct:  # my own rows: every one counted here (padding aside)
            ids, weights = self._route(x, ctx.ep.rank * len(x), self.real)
            return ctx.moe_tp.all_reduce(self._gather_now(x, ids, weights, replicated=False))
        stage_x = ctx.dp.all_gather(x, dim=0)  # equal counts: no count exchange
        mine = ctx.dp.rank * len(x)
        real = None
        if self.real is not None:
            real = self.real if ctx.dp.size == 1 else ctx.dp.all_gather(self.real.to(torch.uint8), dim=0).bool()
        keep = self._counted(len(stage_x), x.device)
        ids, weights = self._route(stage_x, 0, keep if real is None else keep & real)
        y = ctx.moe_tp.all_reduce(self._gather_now(stage_x, ids, weights, replicated=True))
        return y[mine:mine + len(x)]

    def _counted(self, rows: int, device) -> torch.Tensor:
        """[rows] this ep rank's tensor_split chunk of the stage's rows: the ones it counts, so the
        group counts each once."""
        per, extra = divmod(rows, self.ctx.ep.size)
        start = self.ctx.ep.rank * per + min(self.ctx.ep.rank, extra)
        at = torch.arange(rows, device=device)
        return (at >= start) & (at < start + per + (self.ctx.ep.rank < extra))

    def routed_steps(self, x: torch.Tensor, overlap: bool = False):
        """The routed experts' sum for x, eager, as an overlapped step (comm/pending.py)."""
        ctx = self.ctx
        if self.direct:  # my own rows: every one counted here
            first = ctx.ep.rank * len(x)  # a place for my rows among the ep group's (the copy choice)
            counts = row_counts(ctx.ep, len(x)) if self.may_gather else [len(x)]
            if self.gathers(max(counts)):  # every ep rank sees the same counts: they agree
                y = yield from self._gather(x, replicated=False, rows=max(counts), first=first, overlap=overlap)
            else:
                y = yield from self._all_to_all(x, first=first, overlap=overlap)
            return ctx.moe_tp.all_reduce(y)
        counts = row_counts(ctx.dp, len(x))
        stage_x = all_gather_rows(ctx.dp, x, counts)  # [stage tokens, hidden]
        mine = sum(counts[: ctx.dp.rank])
        per, extra = divmod(len(stage_x), ctx.ep.size)  # torch.tensor_split's sizes
        chunks = [per + (r < extra) for r in range(ctx.ep.size)]
        start = sum(chunks[: ctx.ep.rank])
        if self.gathers(-(-len(stage_x) // ctx.ep.size)):
            # the stage's tokens are on every ep rank already: no gather over ep. Every ep rank
            # routes them all; each counts its tensor_split chunk, so the group counts each once
            y = yield from self._gather(stage_x, replicated=True, first=0,
                                        keep=self._counted(len(stage_x), x.device), overlap=overlap)
            return ctx.moe_tp.all_reduce(y)[mine:mine + len(x)]
        y = yield from self._all_to_all(stage_x[start:start + chunks[ctx.ep.rank]], first=start, overlap=overlap)
        stage_y = all_gather_rows(ctx.ep, ctx.moe_tp.all_reduce(y), chunks)
        return stage_y[mine:mine + len(x)]

    def _route(self, xs: torch.Tensor, first, keep: torch.Tensor | None):
        """The router's choice for xs, each pair sent to a physical slot, the kept rows counted
        -> (slots [n, k], weights [n, k])."""
        ids, weights = self.gate(xs)
        if self.expert_map is not None:
            ids = self.expert_map.route(ids, first)
        self.expert_load.count(ids, keep)
        return ids, weights

    def _all_to_all(self, xs: torch.Tensor, *, first, overlap: bool):
        """xs: [this ep rank's share, hidden] through the Dispatcher -> moe_tp partial sums
        (an overlapped step: yields while the dispatch, then the combine, fly)."""
        ids, weights = self._route(xs, first, None)
        d = self.dispatcher.dispatch(xs, ids, weights, async_op=overlap)
        yield
        d = ready(d)
        y = self.dispatcher.combine(self.experts(d.rows, d.row_experts()), d, async_op=overlap)
        yield
        return ready(y)

    def _gather(self, xs: torch.Tensor, *, replicated: bool, rows: int | None = None, first=0,
                keep: torch.Tensor | None = None, overlap: bool = False):
        """xs through gather_combine -> moe_tp partial sums; rows: pad to this many first (the
        padding routes nowhere: ids -1, weights 0) and cut back after; keep: the rows counted."""
        ids, weights = self._route(xs, first, keep)
        n = len(xs)
        if rows is not None and rows > n:
            xs = torch.cat([xs, xs.new_zeros(rows - n, xs.shape[1])])
            ids = torch.cat([ids, ids.new_full((rows - n, ids.shape[1]), -1)])
            weights = torch.cat([weights, weights.new_zeros(rows - n, weights.shape[1])])
        d = self.dispatcher
        y = yield from gather_combine_steps(xs, ids, weights, self.experts.weighted, self.ctx.ep, d.split,
                                            replicated=replicated, counters=self.exchange_bytes,
                                            island_of=d.island_of, overlap=overlap)
        return y[:n]

    def _gather_now(self, xs: torch.Tensor, ids: torch.Tensor, weights: torch.Tensor, *, replicated: bool):
        """xs routed to (ids, weights) through gather_combine, blocking -> moe_tp partial sums."""
        d = self.dispatcher
        return gather_combine(xs, ids, weights, self.experts.weighted, self.ctx.ep, d.split,
                              replicated=replicated, counters=self.exchange_bytes, island_of=d.island_of)
