"""Dispatcher: MoE token dispatch and combine over the ep group.

    d = dispatcher.dispatch(x, topk_ids, topk_weights)  # x: [tokens, hidden], ids/weights: [tokens, k]
    outs = [expert[e](rows) for e, rows in zip(dispatcher.local_experts, d.per_expert())]
    y = dispatcher.combine(torch.cat(outs), d)            # [tokens, hidden]

combine gives, for each token, the sum over its top-k of weight * expert output, in the
original token order. Expert e lives on the ep rank whose contiguous block holds it; the first
num_experts % ep ranks hold one more (routing.expert_split).

Flat: count rows per expert, exchange the counts (one small all_to_all), sort the
(token, expert) pairs by expert, so each destination's rows are contiguous and grouped by its
local experts, one uneven all_to_all, reorder the received [source][expert] blocks to
[expert][source]; combine runs the inverse all_to_all and the weighted sum. Within an expert
the rows arrive in (source rank, token) order. With grouped=False the reorder (one copy of the
rows each way) is skipped: rows stay in arrival order, source rank then local expert, for
expert kernels that take each row's expert (Dispatched.row_experts) and write in place.

Hierarchical (island first, as DeepEP and Tutel's 2D all-to-all do it): a token bound for any
experts on a remote island crosses once, with its expert ids and weights, to one relay rank
there (routing.relay_rank); each rank then runs the flat step inside its island only, over its
own tokens and the ones relayed to it. combine reduces inside the island (weighted) and sends one
partial sum per (token, remote island) back across. Within an expert the row order is then
by relay, not by source. Given the ParallelContext's subgroups (islands of one size), the
cross-island leg runs over this rank's "rail" group (the ranks at its position in every
island: exactly its relays and the ranks it relays for) and the intra-island leg over its
island's own group, so no collective of this path spans the whole ep group; otherwise both
legs are all_to_alls over the ep group with zero splits outside their peers.

combine takes the expert outputs in the order of Dispatched.rows and sums in their dtype.

Dropless by default. With capacity_factor the rule of routing.capacity_keep applies: each expert
keeps the first ceil(capacity_factor * pairs / num_experts) (token, expert) pairs of the step in
(source rank, token, slot) order; dropped pairs contribute 0. Negative expert ids are ignored.

async_op=True (dispatch and combine): the flat path's row exchange starts and a
comm.pending.Pending comes back (the count exchange before it stays blocking: its sizes are
read on the host); the island-first path runs its two legs in turn and returns a Pending
already done. Two-batch overlap computes the other micro-batch meanwhile.

`bytes` counts every byte this rank sent per link class ("intra": inside its island, "cross":
across islands; islands=None is one island), `row_bytes` only the hidden-state rows of it.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from atoll.comm.group import Group
from atoll.comm.pending import Pending
from atoll.comm.routing import (capacity_keep, capacity_of, check_islands, expert_major,
                                expert_owner, expert_split, expert_starts, island_index,
                                relay_rank, sort_by_key)
from atoll.errors import ConfigError


@dataclass
class Leg:
    """One all_to_all over `group` (the ep group or one of its subgroups), and what undoing
    it needs. Splits are per member of `group`; peers[j] is member j's ep rank."""
    src: torch.Tensor             # [n_send] input row each sent row copies, grouped by destination
    send_splits: list[int]
    recv_splits: list[int]
    n_in: int                     # input rows (tokens) of this leg
    group: Group | None = None
    peers: list[int] | None = None
    regroup: torch.Tensor | None = None    # [n_recv] received rows -> expert-major; None: already
    unregroup: torch.Tensor | None = None  # its inverse, for the way back
    bag: tuple | None = None      # (pair rows in token order, per-token offsets, weights) for the
    #                               weighted sum on the way back; None: plain add into src rows
    row_bytes: int = 0            # bytes of one row on the way out (hidden + packed metadata)


@dataclass
class Dispatched:
    rows: torch.Tensor          # [n_recv, hidden] rows for this rank's experts (order: see grouped)
    source_counts: list[list[int]]  # [ep][local experts] rows each source sent each local expert
    grouped: bool               # True: rows expert-major; False: arrival order, source-major
    legs: tuple[Leg, ...]       # the all_to_alls dispatch made, in order; combine undoes them
    n_tokens: int
    dropped: int = 0            # (token, expert) pairs of this rank dropped by capacity

    @property
    def expert_counts(self) -> list[int]:
        """Rows per local expert, in Dispatcher.local_experts order."""
        return [sum(col) for col in zip(*self.source_counts)]

    def row_experts(self) -> torch.Tensor:
        """[n_recv] local expert index (0-based) of each row of rows."""
        which = torch.arange(len(self.source_counts[0]), device=self.rows.device)
        if self.grouped:
            sizes = self.expert_counts
        else:  # blocks: source rank, then local expert
            sizes, which = sum(self.source_counts, []), which.repeat(len(self.source_counts))
        return torch.repeat_interleave(which, torch.tensor(sizes, dtype=torch.long, device=which.device))

    def per_expert(self) -> list[torch.Tensor]:
        """Each local expert's rows (views when grouped; copies in arrival order)."""
        if self.grouped:
            return list(self.rows.split(self.expert_counts))
        blocks = self.rows.split(sum(self.source_counts, []))
        n_local = len(self.source_counts[0])
        return [torch.cat(blocks[e::n_local]) for e in range(n_local)]


class Dispatcher:
    def __init__(self, group: Group, num_experts: int, *, islands=None,
                 capacity_factor: float | None = None, hierarchical: bool = False, grouped: bool = True,
                 island_group: Group | None = None, rail_group: Group | None = None):
        if num_experts < 1:
            raise ConfigError(f"num_experts={num_experts} must be at least 1")
        if capacity_factor is not None and not capacity_factor > 0:
            raise ConfigError(f"capacity_factor={capacity_factor} must be positive")
        self.group = group
        self.num_experts = num_experts
        self.split = expert_split(num_experts, group.size)
        self.starts = expert_starts(self.split)
        me = group.rank
        self.local_experts = range(self.starts[me], self.starts[me] + self.split[me])
        self.islands = [list(range(group.size))] if islands is None else check_islands(islands, group.size)
        self.island_of = island_index(self.islands, group.size)
        if hierarchical and len(self.islands) < 2:
            raise ConfigError(f"hierarchical dispatch needs at least 2 islands, got {self.islands}")
        self.hierarchical = hierarchical
        everyone = (group, list(range(group.size)))
        self._island, self._rail = everyone, everyone  # (group, its members' ep ranks) of each leg
        if hierarchical and island_group is not None and rail_group is not None:
            self._island, self._rail = self._subgroups(island_group, rail_group) or (everyone, everyone)
        self.capacity_factor = capacity_factor
        self.grouped = grouped
        self.bytes: Counter = Counter()      # all bytes sent, per link class
        self.row_bytes: Counter = Counter()  # hidden-state rows only, per link class

    @property
    def num_local_experts(self) -> int:
        return len(self.local_experts)

    def expert_owner(self, ids: torch.Tensor) -> torch.Tensor:
        return expert_owner(ids, self.split)

    def reset_counters(self) -> None:
        self.bytes.clear()
        self.row_bytes.clear()

    @property
    def two_level(self) -> bool:
        """Whether the island-first path runs on the rail and island subgroups."""
        return self._rail[0] is not self.group

    def _subgroups(self, island: Group, rail: Group):
        """((island group, its ep ranks), (rail group, its ep ranks)) when the islands are all
        one size (a rail has one rank per island), else None."""
        islands, me = self.islands, self.group.rank
        mine = islands[self.island_of[me]]
        if len({len(i) for i in islands}) != 1:
            return None
        pos = mine.index(me)
        rail_peers = [isl[pos] for isl in islands]
        for g, peers in ((island, mine), (rail, rail_peers)):
            if g.ranks != tuple(self.group.ranks[p] for p in peers):
                raise ValueError(f"{g} does not match islands {islands} of {self.group}")
        return (island, list(mine)), (rail, rail_peers)

    # ---- public API -------------------------------------------------------------------------

    def dispatch(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor, *,
                 async_op: bool = False):
        # x: [tokens, hidden]; topk_ids, topk_weights: [tokens, k]
        if x.dim() != 2 or topk_ids.dim() != 2 or topk_ids.shape[0] != x.shape[0] \
                or topk_weights.shape != topk_ids.shape:
            raise ValueError(f"dispatch wants x [tokens, hidden] and topk ids/weights [tokens, k]; got "
                             f"{tuple(x.shape)}, {tuple(topk_ids.shape)}, {tuple(topk_weights.shape)}")
        ids, w = topk_ids.long(), topk_weights.float()
        kept, dropped = None, 0
        if self.capacity_factor is not None:
            ids, kept, dropped = self._drop(ids)
        if not self.hierarchical:
            leg, counts = self._expert_leg(ids, w, self._island, list(range(self.group.size)), kept)
            rows = self._forward(x, leg, async_op=async_op)
            made = lambda r: Dispatched(r, counts, self.grouped, (leg,), x.shape[0], dropped)  # noqa: E731
            return rows.map(made) if async_op else made(rows)
        cross, x_r, ids_r, w_r = self._cross_leg(x, ids, w)
        mine = self.island_of[self.group.rank]
        island_ids = torch.tensor(self.island_of, device=ids.device)[self.expert_owner(ids.clamp(min=0))]
        own = torch.where((ids >= 0) & (island_ids == mine), ids, -1)  # my tokens' experts on my island
        leg, counts = self._expert_leg(torch.cat([own, ids_r]), torch.cat([w, w_r]), self._island,
                                       self.islands[mine])
        rows = self._forward(torch.cat([x, x_r]), leg)  # relayed rows ride after my own tokens
        d = Dispatched(rows, counts, self.grouped, (cross, leg), x.shape[0], dropped)
        return Pending.done(d) if async_op else d

    def combine(self, expert_out: torch.Tensor, d: Dispatched, *, async_op: bool = False):
        # expert_out: [n_recv, hidden] in d.rows order -> [tokens, hidden]; sums in its dtype
        if expert_out.dim() != 2 or expert_out.shape[0] != d.rows.shape[0]:
            raise ValueError(f"combine wants [{d.rows.shape[0]}, hidden] expert outputs, got "
                             f"{tuple(expert_out.shape)}")
        if len(d.legs) == 1:
            return self._backward(expert_out, d.legs[0], async_op=async_op)
        out = self._backward(expert_out, d.legs[-1])  # [leg.n_in, hidden] weighted sum per token
        # hierarchical: the relayed tokens' island sums go back across
        part, out = out[d.n_tokens:], out[:d.n_tokens]
        self._backward(part, d.legs[0], out)
        return Pending.done(out) if async_op else out

    # ---- steps ------------------------------------------------------------------------------

    def _count(self, splits: list[int], nbytes: int, payload: int = 0, peers=None) -> None:
        """splits[i]: rows sent to ep rank peers[i] (default: ep rank i)."""
        me = self.group.rank
        for j, n in zip(peers if peers is not None else range(len(splits)), splits):
            if n and j != me:
                link = "intra" if self.island_of[j] == self.island_of[me] else "cross"
                self.bytes[link] += n * nbytes
                self.row_bytes[link] += n * payload

    def _drop(self, ids: torch.Tensor):
        """Apply the capacity rule; returns (ids with dropped pairs set to -1, kept pairs per
        (source rank, expert) [ep, E], pairs this rank dropped)."""
        E, me = self.num_experts, self.group.rank
        valid = ids.reshape(-1) >= 0
        mine = torch.bincount(ids.reshape(-1)[valid], minlength=E)
        counts = self._gather_counts(mine)  # [ep, E] every rank's pairs per expert
        cap = capacity_of(self.capacity_factor, int(counts.sum()), E)
        keep = capacity_keep(ids, counts, me, cap)
        before = counts.cumsum(0) - counts
        kept = torch.minimum(counts, (cap - before).clamp(min=0))
        dropped = int(valid.sum()) - int(kept[me].sum())
        return torch.where(keep, ids, -1), kept, dropped

    def _gather_counts(self, mine: torch.Tensor) -> torch.Tensor:
        """[ep, E] every ep rank's `mine` ([E]): over the ep group, or on the subgroups over
        the island, then the rail (rows come island by island)."""
        E = mine.numel()
        if not self.two_level:
            self._count([1] * self.group.size, E * 8)
            return self.group.all_gather(mine[None], dim=0)
        (island, mates), (rail, relays) = self._island, self._rail
        self._count([1] * len(mates), E * 8, peers=mates)
        part = island.all_gather(mine[None], dim=0)  # [island size, E]
        self._count([1] * len(relays), part.numel() * 8, peers=relays)
        every = rail.all_gather(part, dim=0)  # [islands * island size, E]
        order = torch.tensor([r for isl in self.islands for r in isl], device=mine.device)
        return torch.empty_like(every).index_copy_(0, order, every)

    def _expert_leg(self, ids: torch.Tensor, w: torch.Tensor, over, peers: list[int], kept=None):
        """Plan the all_to_all of (token, expert) pairs to the experts' ranks among `peers`,
        over (group, its members' ep ranks) `over`. ids, w: [n, k]; kept: [ep, E] pair counts
        when the capacity step already knows them."""
        P, E, L, k = self.group.size, self.num_experts, self.num_local_experts, ids.shape[1]
        me, split, st = self.group.rank, self.split, self.starts
        group, members = over
        flat = ids.reshape(-1)
        order, counts = sort_by_key(flat, E)  # pairs grouped by expert, token order inside
        if kept is not None:
            recv = kept[:, st[me]:st[me] + L]  # [ep, L] rows each source sends each local expert
        else:  # tell each peer how many rows it gets per local expert
            inside = [j for j in members if j in peers]
            send = torch.cat([counts[st[j]:st[j] + split[j]] for j in inside])
            splits = [split[j] * (j in peers) for j in members]
            got = group.all_to_all(send, splits, [L * (s in peers) for s in members])
            self._count(splits, 8, peers=members)
            recv = counts.new_zeros(P, L)
            recv[torch.tensor(inside, dtype=torch.long, device=recv.device)] = got.view(len(inside), L)
        host = torch.cat([counts, recv.reshape(-1)]).tolist()  # one device sync for all sizes
        send_splits = [sum(host[st[j]:st[j] + split[j]]) for j in members]
        by_src = [host[E + s * L:E + (s + 1) * L] for s in range(P)]
        # combine: each token's pairs, found in the returned (sorted) rows, in token order
        valid = flat >= 0
        at = torch.empty_like(flat)
        at[order] = torch.arange(order.numel(), device=flat.device)
        per_token = valid.view(ids.shape).sum(1)
        bag = (at[valid], per_token.cumsum(0) - per_token, w.reshape(-1)[valid])
        regroup = expert_major(recv) if self.grouped else None
        unregroup = None
        if regroup is not None:
            unregroup = torch.empty_like(regroup)
            unregroup[regroup] = torch.arange(regroup.numel(), device=regroup.device)
        leg = Leg(src=order // k, send_splits=send_splits, recv_splits=[sum(by_src[s]) for s in members],
                  n_in=ids.shape[0], group=group, peers=members, regroup=regroup, unregroup=unregroup, bag=bag)
        return leg, by_src

    def _forward(self, x: torch.Tensor, leg: Leg, *, async_op: bool = False):
        leg.row_bytes = x.shape[1] * x.element_size()
        send = x.index_select(0, leg.src)  # [n_send, hidden] by destination rank, then local expert
        recv = leg.group.all_to_all(send, leg.send_splits, leg.recv_splits, async_op=async_op)
        self._count(leg.send_splits, leg.row_bytes, leg.row_bytes, peers=leg.peers)
        regroup = (lambda r: r) if leg.regroup is None else (lambda r: r.index_select(0, leg.regroup))
        return recv.map(regroup) if async_op else regroup(recv)

    def _backward(self, y: torch.Tensor, leg: Leg, out: torch.Tensor | None = None, *, async_op: bool = False):
        """Undo leg: send y's rows back where they came from; then either the weighted sum per
        token ([leg.n_in, hidden], y's dtype) or, without a bag, add them into out's src rows."""
        if leg.unregroup is not None:
            y = y.index_select(0, leg.unregroup)
        row = y.shape[1] * y.element_size()
        got = leg.group.all_to_all(y, leg.recv_splits, leg.send_splits, async_op=async_op)
        self._count(leg.recv_splits, row, row, peers=leg.peers)

        def summed(y):
            if leg.bag is None:
                return out.index_add_(0, leg.src, y.to(out.dtype))
            rows, offsets, weights = leg.bag
            return F.embedding_bag(rows, y, offsets, mode="sum", per_sample_weights=weights.to(y.dtype))
        return got.map(summed) if async_op else summed(got)

    def _cross_leg(self, x: torch.Tensor, ids: torch.Tensor, w: torch.Tensor):
        """Send each token once to the relay of every remote island holding any of its experts,
        packed with its ids on that island (others -1) and its weights. Returns (leg, relayed
        x [n, hidden], relayed ids [n, k], relayed weights [n, k])."""
        me, k, H = self.group.rank, ids.shape[1], x.shape[1]
        islands, island_of = self.islands, self.island_of
        mine = island_of[me]
        valid = ids >= 0
        isl = torch.tensor(island_of, device=ids.device)[self.expert_owner(ids.clamp(min=0))]
        isl = torch.where(valid, isl, len(islands))  # [tokens, k] island of each expert
        touched = torch.zeros(ids.shape[0], len(islands) + 1, dtype=torch.bool, device=ids.device)
        touched.scatter_(1, isl, True)
        touched[:, mine] = False
        relays = [relay_rank(me, isl_ranks, islands, island_of) for isl_ranks in islands]
        group, members = self._rail  # the rail, or the whole ep group
        at = {p: j for j, p in enumerate(members)}
        tok, dest = touched[:, :len(islands)].nonzero(as_tuple=True)  # by token, then island
        order, counts = sort_by_key(torch.tensor([at[r] for r in relays], device=ids.device)[dest], len(members))
        tok, dest = tok[order], dest[order]
        # row: [k int32 ids | k fp32 weights | hidden | pad to 8 bytes] so each part views in place
        hb = H * x.element_size()
        packed = torch.empty(tok.numel(), 8 * k + hb + (-hb % 8), dtype=torch.uint8, device=x.device)
        packed[:, 8 * k + hb:] = 0
        packed[:, :4 * k].view(torch.int32).copy_(torch.where(isl[tok] == dest[:, None], ids[tok], -1))
        packed[:, 4 * k:8 * k].view(torch.float32).copy_(w[tok])
        packed[:, 8 * k:8 * k + hb].view(x.dtype).copy_(x.index_select(0, tok))
        send_splits = counts.tolist()
        # exchange row counts with my relays and with the ranks I relay for
        to = [r for r in members if r in {relays[i] for i in range(len(islands)) if i != mine}]
        frm = [s for s in members if island_of[s] != mine
               and relay_rank(s, islands[mine], islands, island_of) == me]
        got = group.all_to_all(torch.tensor([send_splits[at[r]] for r in to], device=ids.device),
                               [int(j in to) for j in members], [int(s in frm) for s in members])
        self._count([int(j in to) for j in members], 8, peers=members)
        recv_splits = [0] * len(members)
        for s, n in zip(frm, got.tolist()):
            recv_splits[at[s]] = n
        recv = group.all_to_all(packed, send_splits, recv_splits)
        self._count(send_splits, packed.shape[1], hb, peers=members)
        leg = Leg(src=tok, send_splits=send_splits, recv_splits=recv_splits, n_in=ids.shape[0],
                  group=group, peers=members, row_bytes=packed.shape[1])
        x_r = recv[:, 8 * k:8 * k + hb].view(x.dtype)
        return leg, x_r, recv[:, :4 * k].view(torch.int32).long(), recv[:, 4 * k:8 * k].view(torch.float32)
