"""The MoE block: a replicated router, routed experts sharded over ep (and each expert over
moe_tp), tokens moved by the Dispatcher, optional shared experts over tp.

One pipeline stage's tp*dp ranks are the MoE's ep x moe_tp grid. When tp == moe_tp, ep rank
e is DP rank e and its own tokens are its share ("direct": DP4EP4, TP2 with pure TP
experts). Otherwise (TP4EP4: tokens replicated over tp) the stage's tokens are gathered over
dp, split evenly into ep chunks, each chunk routed by its ep rank, and the results gathered
back over ep.

Dispatch: island-first (the Dispatcher's hierarchical path, on the context's rail and
ep_island subgroups) when the ep group spans more than one island, flat inside one;
ctx.options.dispatch ("flat", "hierarchical") overrides, ctx.options.capacity_factor caps
each expert's rows (None: dropless). Keywords given to SparseMoE win over the context's.
"""

from __future__ import annotations

import torch
from torch import nn

from atoll.comm.dispatch import Dispatcher
from atoll.comm.gather import all_gather_rows, row_counts
from atoll.comm.group import Group
from atoll.kernels import fused_moe
from atoll.layers.linear import _param, copy_into, divide
from atoll.layers.router import Router


class Experts(nn.Module):
    """This rank's routed experts, a contiguous block `local` of the expert ids, each sharded
    over moe_tp along the intermediate dim. w13: [experts_local, 2*inter/moe_tp, hidden] with
    gate rows then up rows; w2: [experts_local, hidden, inter/moe_tp]. Outputs are partial
    sums over moe_tp."""

    def __init__(self, local: range, hidden: int, inter: int, group: Group, *, dtype=None):
        super().__init__()
        self.local, self.group = local, group
        self.inter_local = divide(inter, group.size, "moe_intermediate_size")
        self.w13 = _param(len(local), 2 * self.inter_local, hidden, dtype=dtype)
        self.w13.weight_loader = self._load_w13
        self.w13.shards = tuple((e, part) for e in local for part in (0, 1))
        self.w2 = _param(len(local), hidden, self.inter_local, dtype=dtype)
        self.w2.weight_loader = self._load_w2
        self.w2.shards = tuple((e, "down") for e in local)

    def _load_w13(self, param, src, shard):
        e, part = shard
        if e not in self.local:
            return False  # another ep rank's expert: never read
        n, start = self.inter_local, self.group.rank * self.inter_local
        copy_into(param.data[e - self.local.start, part * n:(part + 1) * n], src[start:start + n])

    def _load_w2(self, param, src, shard):
        e, _ = shard
        if e not in self.local:
            return False
        start = self.group.rank * self.inter_local
        copy_into(param.data[e - self.local.start], src[:, start:start + self.inter_local])

    def forward(self, rows: torch.Tensor, local_ids: torch.Tensor) -> torch.Tensor:
        """rows: [n_recv, hidden] in any order, local_ids: [n_recv] each row's local expert ->
        [n_recv, hidden]; the routing weights are applied later, by combine."""
        ones = torch.ones(len(rows), 1, device=rows.device)
        return fused_moe(rows, self.w13, self.w2, local_ids[:, None], ones)


def make_dispatcher(ctx, num_experts: int, *, islands=None, hierarchical: bool | None = None,
                    capacity_factor: float | None = None, grouped: bool = True) -> Dispatcher:
    """The Dispatcher over ctx.ep, island-first when its ep group spans islands (see above)."""
    from atoll.errors import ConfigError

    options = getattr(ctx, "options", None)
    mode = options.dispatch if options is not None else "auto"
    if capacity_factor is None and options is not None:
        capacity_factor = options.capacity_factor
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


class SparseMoE(nn.Module):
    """Routed experts, plus optional shared experts: Qwen2-MoE's `shared_expert` scaled by
    sigmoid(shared_expert_gate(x)), or DeepSeek-V3's always-on `shared_experts`."""

    def __init__(self, *, hidden: int, inter: int, router: Router, ctx, dtype=None,
                 shared: nn.Module | None = None, shared_gate: nn.Module | None = None,
                 islands=None, hierarchical: bool | None = None, capacity_factor: float | None = None):
        super().__init__()
        self.ctx = ctx
        self.shared_name = "shared_expert" if shared_gate is not None else "shared_experts"
        if shared is not None:
            setattr(self, self.shared_name, shared)  # named as in the checkpoint
        self.shared_expert_gate = shared_gate
        self.gate = router
        # arrival order: the experts take each row's expert id, so rows need no sort by expert
        self.dispatcher = make_dispatcher(ctx, router.num_experts, islands=islands, hierarchical=hierarchical,
                                          capacity_factor=capacity_factor, grouped=False)
        self.experts = Experts(self.dispatcher.local_experts, hidden, inter, ctx.moe_tp, dtype=dtype)
        self.direct = ctx.layout.tp == ctx.layout.moe_tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x: [tokens of this DP rank, hidden], the same on its tp ranks -> same shape."""
        y = self.routed(x)
        shared = getattr(self, self.shared_name, None)
        if shared is None:
            return y
        if self.shared_expert_gate is None:
            return y + shared(x)
        return y + torch.sigmoid(self.shared_expert_gate(x)) * shared(x)

    def routed(self, x: torch.Tensor) -> torch.Tensor:
        ctx = self.ctx
        if self.direct:
            xs = x
        else:
            counts = row_counts(ctx.dp, len(x))
            stage_x = all_gather_rows(ctx.dp, x, counts)  # [stage tokens, hidden]
            per, extra = divmod(len(stage_x), ctx.ep.size)  # torch.tensor_split's sizes
            chunks = [per + (r < extra) for r in range(ctx.ep.size)]
            start = sum(chunks[: ctx.ep.rank])
            xs = stage_x[start:start + chunks[ctx.ep.rank]]  # this ep rank's share
        ids, weights = self.gate(xs)
        d = self.dispatcher.dispatch(xs, ids, weights)
        y = self.dispatcher.combine(self.experts(d.rows, d.row_experts()), d)
        y = ctx.moe_tp.all_reduce(y)  # sum the moe_tp partials
        if self.direct:
            return y
        stage_y = all_gather_rows(ctx.ep, y, chunks)
        mine = sum(counts[: ctx.dp.rank])
        return stage_y[mine:mine + len(x)]
