"""Elastic EP: the expert placement an ep group keeps after losing ranks. Plain arithmetic,
no torch, like comm/eplb.py.

The survivors keep their slots and the weights in them: nothing moves between them. They are
renumbered in their old order (old ep rank survivors[i] is new ep rank i). Each logical expert
whose every copy sat on a lost rank (an orphan) is loaded again from the checkpoint into a
survivor's slot:
- a spare slot first: one holding a copy of an expert that still has two or more copies on
  the survivors (the expert with the most copies gives one up; ties: the later slot), on the
  survivor that has taken the fewest loads so far;
- else a new slot, appended to the survivor with the fewest slots (ties: the lower rank).
An orphan the checkpoint cannot load has no source at all: `ExpertLost` names it, before
anything changes. An expert is never dropped silently.
"""

from __future__ import annotations

from dataclasses import dataclass

from atoll.comm.eplb import Placement
from atoll.errors import ConfigError, ExpertLost


@dataclass(frozen=True)
class Load:
    """Local slot `slot` of new ep rank `rank` takes `expert`'s weights from the checkpoint."""

    rank: int
    slot: int
    expert: int


@dataclass(frozen=True)
class Survival:
    """A layer's placement over the survivors, which old ep rank each new one was, and the
    experts to load from the checkpoint (those that had no copy left)."""

    placement: Placement
    survivors: tuple[int, ...]
    loads: tuple[Load, ...]


def survivors_of(ep: int, lost) -> tuple[int, ...]:
    """The old ep ranks that remain, in order (the new ranks' order)."""
    lost = set(lost)
    if not lost or not lost <= set(range(ep)):
        raise ConfigError(f"lost ep ranks {sorted(lost)} must be some of the ep group's ranks 0..{ep - 1}")
    if len(lost) == ep:
        raise ConfigError(f"every one of the ep group's {ep} ranks is lost: nothing survives")
    return tuple(r for r in range(ep) if r not in lost)


def survive(placement: Placement, lost, loadable=None, *, layer: int = 0) -> Survival:
    """The placement after losing ep ranks `lost`. loadable(expert) -> bool: whether the
    checkpoint can load that expert again (None: it can load none)."""
    keep = survivors_of(placement.ep, lost)
    held = [placement.local(r) for r in keep]  # per new rank, its experts in slot order
    left = {e for experts in held for e in experts}
    orphans = [e for e in range(placement.num_logical) if e not in left]
    for e in orphans:
        if loadable is None or not loadable(e):
            raise ExpertLost(layer, e, sorted(set(range(placement.ep)) - set(keep)))
    copies = [0] * placement.num_logical
    for experts in held:
        for e in experts:
            copies[e] += 1
    taken = [0] * len(held)
    loads = []
    for e in orphans:
        spares = [(copies[x], j, -taken[r], r) for r, experts in enumerate(held) for j, x in enumerate(experts)
                  if copies[x] > 1]
        if spares:
            # most copies first, then the survivor with the fewest loads, then the later slot
            _, j, _, r = max(spares, key=lambda s: (s[0], s[2], -s[3], s[1]))
            copies[held[r][j]] -= 1
            held[r][j] = e
        else:
            r = min(range(len(held)), key=lambda i: (len(held[i]), i))
            held[r].append(e)
            j = len(held[r]) - 1
        copies[e] += 1
        taken[r] += 1
        loads.append(Load(r, j, e))
    phy2log = tuple(e for experts in held for e in experts)
    new = Placement(phy2log, tuple(len(experts) for experts in held), placement.num_logical)
    return Survival(new, keep, tuple(loads))


def survive_layers(placements: dict, lost, loadable=None) -> dict[int, Survival]:
    """`survive` for every MoE layer, {layer id: placement} (their placements differ once
    rebalanced); loadable(layer, expert) -> bool. The first layer with an expert without a
    source raises, naming both."""
    out = {}
    for layer, placement in placements.items():
        can = None if loadable is None else (lambda e, layer=layer: loadable(layer, e))
        out[layer] = survive(placement, lost, can, layer=layer)
    return out
