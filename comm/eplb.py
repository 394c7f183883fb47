"""Expert placement for load balancing (EPLB): which logical expert each physical expert slot
of an ep group holds, chosen from measured loads. Plain arithmetic, no torch: the runtime
(layers/expert_map.py, engine/rank/eplb.py) places with it, and the planner can too.

E logical experts and R redundant slots make P = E + R physical slots. Ep rank r holds the
contiguous slots of expert_split(P, ep)[r], as the Dispatcher splits them, so dispatch moves
physical slot ids exactly as it moved expert ids. A Placement says which logical expert each
slot holds (`phy2log`); every logical expert has at least one slot, a hot one several. The
router picks logical experts; each (token, expert) pair then goes to one of that expert's
copies, the pair's position modulo the copies (layers/expert_map.py), so a copy takes about
load / copies: the load the packing below balances.

`rebalance` is DeepSeek's published EPLB (github.com/deepseek-ai/EPLB, from its description;
this is our own code):
1. replicate: each expert gets one slot, then every spare slot goes to the expert with the
   most load per copy at that moment;
2. pack: the copies, heaviest first, each onto the rank with the least load that still has a
   free slot.
Hierarchical, when the ep group spans islands of one size and the router's expert groups
(DeepSeek-V3's n_group) divide among them: the groups are first packed onto islands by their
load, each island taking as many groups, then each island replicates its own experts onto
its slots and packs them onto its ranks. An expert's copies then all sit in one island, and
group-limited routing (a token's experts lie in topk_group groups) reaches few islands, so
the island-first dispatch crosses islands as little as before. Otherwise one global pass.

The packing's ranks are interchangeable, so the result is relabelled to keep each rank as
many of the experts it held as possible (within an island), and inside a rank an expert
kept stays in its old slot: fewer weights move (`moves` lists those that do).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from atoll.comm.experts import expert_split, expert_starts
from atoll.errors import ConfigError


@dataclass(frozen=True)
class Placement:
    """phy2log[p]: the logical expert slot p holds; split[r]: the slots of ep rank r."""

    phy2log: tuple[int, ...]
    split: tuple[int, ...]
    num_logical: int

    def __post_init__(self):
        if sum(self.split) != len(self.phy2log):
            raise ConfigError(f"a placement of {len(self.phy2log)} slots over ranks holding {list(self.split)}")
        missing = sorted(set(range(self.num_logical)) - set(self.phy2log))
        if missing or any(not 0 <= e < self.num_logical for e in self.phy2log):
            raise ConfigError(f"a placement must hold every one of {self.num_logical} experts once or more "
                              f"(missing {missing[:8]})")

    @classmethod
    def initial(cls, num_experts: int, redundant: int, ep: int) -> "Placement":
        """Before any load is known: slot p holds expert p mod E, so the first E slots are the
        contiguous blocks atoll places without EPLB and the R spare ones copy experts 0..R-1."""
        if redundant < 0:
            raise ConfigError(f"num_redundant_experts={redundant} must be 0 or more")
        slots = num_experts + redundant
        return cls(tuple(p % num_experts for p in range(slots)), tuple(expert_split(slots, ep)), num_experts)

    @property
    def num_slots(self) -> int:
        return len(self.phy2log)

    @property
    def ep(self) -> int:
        return len(self.split)

    def slots_of(self, rank: int) -> range:
        start = expert_starts(list(self.split))[rank]
        return range(start, start + self.split[rank])

    def local(self, rank: int) -> list[int]:
        """The logical expert of each of rank's slots, in slot order."""
        return [self.phy2log[p] for p in self.slots_of(rank)]

    def copies(self) -> list[list[int]]:
        """Each logical expert's slots, ascending."""
        out = [[] for _ in range(self.num_logical)]
        for p, e in enumerate(self.phy2log):
            out[e].append(p)
        return out

    def rank_loads(self, slot_counts) -> list[int]:
        """Tokens each ep rank took, from counts per physical slot."""
        return [sum(slot_counts[p] for p in self.slots_of(r)) for r in range(self.ep)]

    def logical_loads(self, slot_counts) -> list[int]:
        """Tokens each logical expert took, over its copies."""
        out = [0] * self.num_logical
        for p, n in enumerate(slot_counts):
            out[self.phy2log[p]] += n
        return out


def imbalance(loads) -> float:
    """max / mean of per-rank loads: 1.0 is perfect balance; 0.0 when nothing was counted."""
    loads = list(loads)
    total = sum(loads)
    return max(loads) * len(loads) / total if total else 0.0


def replicate(loads: list[float], slots: int) -> list[int]:
    """Copies of each expert over `slots` slots: one each, then each spare slot to the expert
    with the most load per copy (ties: the lower id)."""
    if slots < len(loads):
        raise ConfigError(f"{slots} slots cannot hold {len(loads)} experts")
    copies = [1] * len(loads)
    for _ in range(slots - len(loads)):
        e = max(range(len(loads)), key=lambda i: (loads[i] / copies[i], -i))
        copies[e] += 1
    return copies


def pack(weights: list[float], capacities: list[int]) -> list[int]:
    """The bin of each item: heaviest first, onto the least loaded bin with room (ties: the
    lower bin). sum(capacities) must equal the items."""
    if sum(capacities) != len(weights):
        raise ConfigError(f"{len(weights)} items into bins holding {capacities}")
    load, held, out = [0.0] * len(capacities), [0] * len(capacities), [0] * len(weights)
    for i in sorted(range(len(weights)), key=lambda i: (-weights[i], i)):
        b = min((b for b in range(len(capacities)) if held[b] < capacities[b]), key=lambda b: (load[b], b))
        out[i] = b
        load[b] += weights[i]
        held[b] += 1
    return out


def _place(loads: list[float], experts: list[int], ranks: list[int], split) -> dict[int, list[int]]:
    """experts (ids into loads) replicated onto the slots of `ranks` and packed: rank -> experts."""
    copies = replicate([loads[e] for e in experts], sum(split[r] for r in ranks))
    items = [e for e, c in zip(experts, copies) for _ in range(c)]
    per_copy = {e: loads[e] / c for e, c in zip(experts, copies)}
    bins = pack([per_copy[e] for e in items], [split[r] for r in ranks])
    out = {r: [] for r in ranks}
    for e, b in zip(items, bins):
        out[ranks[b]].append(e)
    return out


def rebalance(loads: list[float], split, *, groups: int = 1, islands=None, old: Placement | None = None) -> Placement:
    """A placement of len(loads) logical experts on slots `split` (per ep rank) from each
    expert's load; islands: lists of ep ranks (None: one); groups: the router's expert groups;
    old: the placement in use, which the result keeps as much of as it can."""
    E, split = len(loads), tuple(split)
    islands = [sorted(i) for i in islands] if islands else [list(range(len(split)))]
    sizes = {len(i) for i in islands}
    per_rank = {split[r] for i in islands for r in i}
    hierarchical = len(islands) > 1 and len(sizes) == 1 and len(per_rank) == 1 and groups % len(islands) == 0 \
        and E % groups == 0
    if hierarchical:
        size = E // groups
        group_loads = [sum(loads[g * size:(g + 1) * size]) for g in range(groups)]
        where = pack(group_loads, [groups // len(islands)] * len(islands))
        chosen = {}
        for i, ranks in enumerate(islands):
            experts = [e for g in range(groups) if where[g] == i for e in range(g * size, (g + 1) * size)]
            chosen |= _place(loads, experts, ranks, split)
        scopes = islands  # an island's ranks swap among themselves
    else:
        chosen = _place(loads, list(range(E)), list(range(len(split))), split)
        scopes = [list(range(len(split)))]
    if old is not None:
        chosen = _relabel(chosen, old, scopes, split)
    phy2log = []
    for r in range(len(split)):
        phy2log += _order(chosen[r], old.local(r) if old is not None else None)
    return Placement(tuple(phy2log), split, E)


def _relabel(chosen: dict[int, list[int]], old: Placement, scopes, split) -> dict[int, list[int]]:
    """Swap whole ranks' expert sets between ranks of one island and one slot count, so each
    rank keeps most of what it held (greedy, largest overlap first)."""
    out = dict(chosen)
    for ranks in scopes:
        for n in {split[r] for r in ranks}:
            same = [r for r in ranks if split[r] == n]
            new = {b: Counter(chosen[b]) for b in same}
            held = {r: Counter(old.local(r)) for r in same}
            pairs = sorted((-sum((new[b] & held[r]).values()), b, r) for b in same for r in same)
            free_b, free_r = set(same), set(same)
            for _, b, r in pairs:
                if b in free_b and r in free_r:
                    out[r] = chosen[b]
                    free_b.discard(b)
                    free_r.discard(r)
    return out


def _order(experts: list[int], held: list[int] | None) -> list[int]:
    """A rank's experts in slot order: one it held stays in its old slot, the rest fill the
    free slots by id."""
    experts = sorted(experts)
    if held is None or len(held) != len(experts):
        return experts
    out: list[int | None] = [None] * len(held)
    rest = list(experts)
    for j, e in enumerate(held):
        if e in rest:
            out[j] = e
            rest.remove(e)
    fill = iter(rest)
    return [e if e is not None else next(fill) for e in out]


@dataclass(frozen=True)
class Move:
    """Slot dst_slot (local index) of ep rank dst takes the weights of src's local slot src_slot."""

    dst: int
    dst_slot: int
    src: int
    src_slot: int


def moves(old: Placement, new: Placement, island_of=None) -> list[Move]:
    """Every slot whose expert changes and where its weights come from: the rank itself when
    it held that expert, else a holder in its island, else any, the senders kept even (the one
    with fewest sends so far, then the lowest rank). Every rank computes the same list."""
    if old.split != new.split:
        raise ConfigError(f"placements over different slots: {list(old.split)} and {list(new.split)}")
    island_of = island_of or [0] * old.ep
    holders = [[] for _ in range(old.num_logical)]  # (rank, local slot) of every old copy
    for r in range(old.ep):
        for j, e in enumerate(old.local(r)):
            holders[e].append((r, j))
    sends, out = [0] * old.ep, []
    for r in range(new.ep):
        before = old.local(r)
        for j, e in enumerate(new.local(r)):
            if before[j] == e:
                continue
            if e in before:
                out.append(Move(r, j, r, before.index(e)))
                continue
            src, slot = min(holders[e], key=lambda h: (island_of[h[0]] != island_of[r], sends[h[0]], h[0]))
            sends[src] += 1
            out.append(Move(r, j, src, slot))
    return out


class LoadReport(dict):
    """The expert load an engine reports (engine/rank/eplb.py): {"layers": {layer: {"tokens":
    per ep rank, "max_mean"}}, "worst_layer", "max_mean", "window_steps", "rebalances",
    "layers_moved", "moved_bytes"}. Drivers add their engines' counters key by key (DP
    replicas behind one server, a disaggregated job's prefill and decode engines); reports
    add up to the worst of them, so one is kept and 0 + a report is the report."""

    def __add__(self, other):
        if not isinstance(other, dict) or not other:
            return self
        return self if self.get("max_mean", 0.0) >= other.get("max_mean", 0.0) else LoadReport(other)

    __radd__ = __add__


def describe(report) -> list[str]:
    """A report as lines (`atoll generate --stats`): the worst layer, then every layer."""
    if not report or not report.get("layers"):
        return []
    moved = report.get("layers_moved", 0)
    out = [f"MoE expert load over the last {report['window_steps']} steps: max/mean tokens per EP rank "
           f"{report['max_mean']:.2f} at worst (layer {report['worst_layer']}); {report['rebalances']} rebalances, "
           f"{moved} layers moved ({report.get('moved_bytes', 0) / 2**20:.1f} MiB)"]
    for layer, entry in report["layers"].items():
        tokens = entry["tokens"]
        # a layer moved near the end restarted its window there: it may have counted nothing yet
        what = f"{entry['max_mean']:.2f}" if sum(tokens) else "-- (nothing counted since its rebalance)"
        out.append(f"  layer {layer}: max/mean {what}, tokens per EP rank {tokens}")
    return out
