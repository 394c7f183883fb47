"""Placement: which GPU of which node runs each rank of a layout.

Ranks take the topology's GPUs island by island (then node by node), so consecutive ranks
share an island: with the rank grid's TP-innermost order every TP group is a block of `tp`
consecutive ranks and lands inside one NVLink island whenever tp divides the island size.
On a cluster without NVLink (every island one GPU) the TP boundary is the node instead:
TP over PCIe inside a box is normal, TP over the network is what we refuse by default.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

from atoll.errors import LaunchError, LayoutError
from atoll.parallel.layout import Layout


def tp_domains(topology) -> list[list[tuple[int, int]]]:
    """The sets a TP group must stay inside: NVLink islands, or nodes if there is no NVLink."""
    if any(len(i) > 1 for i in topology.islands):
        return [list(i) for i in topology.islands]
    return [[(n, g) for g in range(node.gpus)] for n, node in enumerate(topology.nodes)]


def tp_domain_size(topology) -> int:
    return min(len(d) for d in tp_domains(topology))


@dataclass(frozen=True)
class Placement:
    layout: Layout
    slots: tuple[tuple[int, int], ...]  # rank -> (node index, local GPU index)
    node_names: tuple[str, ...]  # node index -> name (hostname, IP or nodeN)
    island: tuple[int, ...]  # rank -> island index in the topology
    replica: int = 0

    def __post_init__(self):
        if len(self.slots) != self.layout.world_size:
            raise LayoutError(
                f"placement has {len(self.slots)} slots for layout {self.layout} of "
                f"{self.layout.world_size} ranks"
            )
        if len(set(self.slots)) != len(self.slots):
            raise LayoutError("placement puts two ranks on one GPU")

    @classmethod
    def build(cls, layout: Layout, topology, *, replica: int = 0,
              allow_cross_island: bool = False) -> "Placement":
        """Ranks of replica `replica` (0-based) of `layout` on `topology`'s GPUs."""
        world, total = layout.world_size, topology.num_gpus
        if (replica + 1) * world > total:
            raise LayoutError(
                f"layout {layout} replica {replica} needs GPUs {replica * world}..{(replica + 1) * world - 1} "
                f"but {topology.name} has {total}"
            )
        domains = tp_domains(topology)
        order = [gid for d in domains for gid in d]
        slots = tuple(order[replica * world:(replica + 1) * world])
        domain_of = {gid: i for i, d in enumerate(domains) for gid in d}
        if not allow_cross_island:
            for start in range(0, world, layout.tp):
                group = slots[start:start + layout.tp]
                if len({domain_of[g] for g in group}) > 1:
                    size = min(len(d) for d in domains)
                    kind = "NVLink island" if any(len(i) > 1 for i in topology.islands) else "node"
                    raise LayoutError(
                        f"TP group of ranks {start}..{start + layout.tp - 1} straddles a {kind} "
                        f"boundary: tp={layout.tp} does not fit the {size}-GPU {kind}s of "
                        f"{topology.name}; use tp <= {size} or allow crossing islands"
                    )
        island = tuple(topology.island_of(g) for g in slots)
        names = tuple(n.name for n in topology.nodes)
        return cls(layout=layout, slots=slots, node_names=names, island=island, replica=replica)

    def node_of(self, rank: int) -> int:
        return self.slots[rank][0]

    def gpu_of(self, rank: int) -> int:
        return self.slots[rank][1]

    def node_name(self, rank: int) -> str:
        return self.node_names[self.node_of(rank)]

    def island_of(self, rank: int) -> int:
        return self.island[rank]

    def ranks_on(self, node: int | str) -> list[int]:
        idx = self.node_names.index(node) if isinstance(node, str) else node
        return [r for r, (n, _) in enumerate(self.slots) if n == idx]

    @property
    def nodes(self) -> list[int]:
        """Node indices this placement uses, in rank order."""
        return list(dict.fromkeys(n for n, _ in self.slots))

    def group_span(self, ranks: list[int]) -> tuple[int, int, int]:
        """(ranks, distinct islands, distinct nodes) of a group of ranks."""
        return (len(ranks), len({self.island[r] for r in ranks}), len({self.slots[r][0] for r in ranks}))

    def to_dict(self) -> dict:
        return {
            "layout": str(self.layout),
            "replica": self.replica,
            "ranks": [{"rank": r, "node": self.node_names[n], "node_index": n, "gpu": g,
                       "island": self.island[r]} for r, (n, g) in enumerate(self.slots)],
        }


def placement_mismatches(placement: Placement, hosts: list[str], gpus: list[int]) -> list[str]:
    """Where a running job differs from `placement`: rank r runs on host hosts[r], local GPU
    gpus[r]. A plan whose node names are none of the hosts (a preset's node0, node1) is matched
    by grouping: the ranks of one planned node must share a host, each node its own host.
    Returns one phrase per differing rank, e.g. "rank 3 on b (plan: a)"."""
    names = placement.node_names
    short = [h.split(".")[0] for h in hosts]
    by_name = any(n in hosts or n in short for n in names)
    host_of: dict[int, str] = {}  # planned node -> the host most of its ranks run on, one host each
    if not by_name:
        for node in placement.nodes:
            seen = Counter(hosts[r] for r in placement.ranks_on(node)).most_common()
            free = [h for h, _ in seen if h not in host_of.values()]
            host_of[node] = (free or [seen[0][0]])[0]
    out = []
    for r, (node, gpu) in enumerate(placement.slots):
        if by_name and names[node] not in (hosts[r], short[r]):
            out.append(f"rank {r} on {hosts[r]} (plan: {names[node]})")
        elif not by_name and host_of[node] != hosts[r]:
            out.append(f"rank {r} on {hosts[r]} (plan: {names[node]}, which runs on {host_of[node]})")
        if gpus[r] != gpu:
            out.append(f"rank {r} on GPU {gpus[r]} (plan: GPU {gpu})")
    return out


def check_job_placement(placement: Placement, hosts: list[str], gpus: list[int], *, strict: bool) -> str | None:
    """The one line saying where the job differs from the plan (None: it does not); raises
    LaunchError with that line when strict."""
    diff = placement_mismatches(placement, hosts, gpus)
    if not diff:
        return None
    more = f" and {len(diff) - 4} more" if len(diff) > 4 else ""
    line = f"the job's ranks differ from the plan: {', '.join(diff[:4])}{more}"
    if strict:
        raise LaunchError(line + " (--strict-placement)")
    return line
