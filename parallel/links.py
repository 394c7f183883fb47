"""Link classes, and the bytes a run sent over each (`atoll generate --stats`).

Every byte one rank sends to another crosses one class of link, the three a Topology names
(Topology.link_between):

- island:  both ranks in one NVLink island (NVLink; an island may span nodes, as an NVL72 rack's);
- node:    different islands of one node (PCIe or the host's fabric inside the box);
- network: different nodes, not in one island (InfiniBand or Ethernet).

A rank's island and node come from its ParallelContext (`island_of`, `node_of`: from the plan's
placement, else one island and one node per host; under Ray, per Ray node).

Counted per rank, then summed over ranks by rank 0:
- MoE dispatch: the bytes each MoE layer's Dispatcher (and its gather exchange, where the layer
  has one) sent, which it counts per peer as inside its island ("intra") or across ("cross").
  "intra" is the island class; "cross" is the node class when every pair of ranks of the ep
  group in different islands shares a node, else the network class (an ep group whose
  islands sit on several nodes, some sharing one, charges all its cross-island bytes to the
  network). `rows`: the hidden-state rows alone, without routing metadata.
- collectives: every byte a Group counted (comm.group: all_reduce and all_gather count the
  tensor, all_to_all the rows sent to others, send the tensor; MoE dispatch included), each
  group's bytes charged to the widest class its members span. Steps run by a compiled graph
  are not counted (comm.group); --enforce-eager counts every step.
"""

from __future__ import annotations

from collections import Counter

CLASSES = ("island", "node", "network")


def pair_class(a: int, b: int, island_of, node_of) -> str:
    """The link class between global ranks a and b."""
    if island_of[a] == island_of[b]:
        return "island"
    return "node" if node_of[a] == node_of[b] else "network"


def group_class(ranks, island_of, node_of) -> str | None:
    """The widest class any two members of `ranks` talk over; None for one rank."""
    ranks = list(ranks)
    seen = {pair_class(a, b, island_of, node_of) for i, a in enumerate(ranks) for b in ranks[i + 1:]}
    return max(seen, key=CLASSES.index) if seen else None


def cross_island_class(ranks, island_of, node_of) -> str:
    """The class charged with a Dispatcher's "cross" bytes over the ep group `ranks`."""
    ranks = list(ranks)
    seen = {pair_class(a, b, island_of, node_of) for i, a in enumerate(ranks) for b in ranks[i + 1:]
            if island_of[a] != island_of[b]}
    return "node" if seen == {"node"} else "network"


def moe_counters(model) -> tuple[list[Counter], list[Counter]]:
    """(bytes, row bytes) Counters, per link class "intra"/"cross", of every MoE layer of model."""
    sent, rows = [], []
    for m in model.modules():
        d = getattr(m, "dispatcher", None)
        if d is None or not hasattr(d, "bytes"):
            continue
        sent.append(d.bytes)
        rows.append(d.row_bytes)
        extra = getattr(m, "exchange_bytes", None)  # a layer's gather exchange, counted the same way
        if extra is not None:
            sent.append(extra)
    return sent, rows


def reset(ctx, model) -> None:
    """Zero every counter rank_bytes reads, so a run counts its own traffic only."""
    for g in ctx.groups.values():
        g.reset_counters()
    for counters in moe_counters(model):
        for c in counters:
            c.clear()


KEYS = ("dispatch", "rows", "collectives", "calls", "ranks")


def rank_bytes(ctx, model, *, compiled: bool = False) -> dict[str, Counter]:
    """This rank's bytes by link class: {"dispatch", "rows", "collectives", "calls"} -> Counter;
    "ranks" counts the ranks ("all") and those that ran a compiled step ("compiled")."""
    out = {k: Counter() for k in KEYS}
    out["ranks"].update(all=1, compiled=int(compiled))
    cross = cross_island_class(ctx.ep.ranks, ctx.island_of, ctx.node_of)
    sent, rows = moe_counters(model)
    for key, counters in (("dispatch", sent), ("rows", rows)):
        for c in counters:
            out[key]["island"] += c.get("intra", 0)
            out[key][cross] += c.get("cross", 0)
    for g in ctx.groups.values():
        cls = group_class(g.ranks, ctx.island_of, ctx.node_of)
        if cls is not None:
            out["collectives"][cls] += sum(g.bytes.values())
            out["calls"][cls] += sum(g.calls.values())
    return out


def total(parts) -> dict[str, Counter]:
    """rank_bytes summed over ranks (None entries skipped)."""
    out = {k: Counter() for k in KEYS}
    for part in parts:
        for k, c in (part or {}).items():
            out[k].update(c)
    return out


def lines(summed: dict[str, Counter]) -> list[str]:
    """One line per link class, what `atoll generate --stats` prints at the end of a run, and
    a note when some rank ran compiled steps (their collectives are not counted)."""
    get = lambda k, cls: int(summed.get(k, {}).get(cls, 0))  # noqa: E731
    ranks = get("ranks", "all")
    out = [f"{cls + ' links:':<15} MoE dispatch {get('dispatch', cls):,} B (rows {get('rows', cls):,} B), "
           f"collectives {get('collectives', cls):,} B in {get('calls', cls):,} calls, summed over {ranks} ranks"
           for cls in CLASSES]
    if get("ranks", "compiled"):
        out.append(f"{get('ranks', 'compiled')} of {ranks} ranks ran compiled decode steps, whose collectives "
                   "are not counted (--enforce-eager counts them)")
    return out
