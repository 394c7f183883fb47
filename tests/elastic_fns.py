"""The rank body of the elastic EP regroup test (tests/comm/test_regroup.py), importable by the
spawned ranks: an ep group holding expert slots by a Placement steps all_reduces until the
fault injection kills one rank; the survivors notice, rejoin without it, load the experts that
had no copy left from the checkpoint, and all_gather their slots for the test to check."""

import time

import torch
import torch.distributed as dist

from atoll.comm import regroup
from atoll.comm.elastic import survive
from atoll.comm.eplb import Placement
from atoll.config.faults import FaultInjection
from atoll.engine.rank.faults import RankFaults


def rank_main(rank, world, port, placement: Placement, faults: str, ckpt: str, loadable, timeout_s, results):
    try:
        results.put((rank, run(rank, world, port, placement, faults, ckpt, loadable, timeout_s)))
    except Exception as e:  # the test reads the one line
        results.put((rank, f"{type(e).__name__}: {e}"))


def run(rank, world, port, placement, faults, ckpt, loadable, timeout_s):
    torch.set_num_threads(1)
    store = regroup.connect("127.0.0.1", port, timeout_s)
    regroup.join(store, 0, rank, world, timeout_s)
    weights = torch.load(ckpt)  # [experts, hidden]: the "checkpoint"
    slots = weights[placement.local(rank)].clone()  # this rank's slot rows
    strike = RankFaults(FaultInjection.parse(faults), rank)
    steps = 0
    while True:
        x = torch.ones(1)
        began = time.monotonic()
        try:
            dist.all_reduce(x)
        except RuntimeError:
            failed = time.monotonic()
            regroup.notice(store, 0, rank)
            break
        assert x.item() == world
        steps += 1
        strike.after_step()
        if steps > 10_000:
            return "no rank was lost"
    # the driver names the survivors of round 1; this rank rejoins among them
    # the new group gets a roomier timeout than the detection's: its ranks connect under load
    new = regroup.rejoin(store, 1, rank, max(timeout_s, 10.0))
    joined = time.monotonic()
    keep = regroup.survivors(store, 1, timeout_s)
    lost = [r for r in range(world) if r not in keep]
    s = survive(placement, lost, (lambda e: e in loadable) if loadable is not None else None)
    mine = s.placement.local(new)
    rows = torch.empty(len(mine), weights.shape[1])
    before = placement.local(rank)
    for j, e in enumerate(mine):
        rows[j] = slots[j] if j < len(before) and before[j] == e else weights[e]  # kept, or loaded
    loaded = [x.expert for x in s.loads if x.rank == new]
    # every survivor's slots, gathered over the new group (uneven: padded to the widest)
    width = max(s.placement.split)
    padded = torch.zeros(width, weights.shape[1])
    padded[:len(mine)] = rows
    out = [torch.empty_like(padded) for _ in keep]
    dist.all_gather(out, padded)
    total = torch.ones(1)
    dist.all_reduce(total)
    gathered = torch.cat([o[:n] for o, n in zip(out, s.placement.split)])
    dist.destroy_process_group()
    return {"new_rank": new, "steps": steps, "world": int(total.item()), "phy2log": list(s.placement.phy2log),
            "gathered": gathered.tolist(), "loaded": loaded, "rejoin_s": joined - failed, "waited_s": failed - began}
