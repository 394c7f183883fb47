"""Group collectives over gloo with real processes."""

import pytest
import torch

from atoll.comm.group import Group
from atoll.errors import RankFailure
from atoll.launch.local import run_local


def _collectives(rank, world):
    g = Group.from_torch(name="world")
    assert g.size == world and g.rank == rank
    x = torch.full((2, 3), float(rank + 1))
    assert torch.equal(g.all_reduce(x.clone()), torch.full((2, 3), float(sum(range(1, world + 1)))))
    gathered = g.all_gather(torch.tensor([[rank]]), dim=1)
    assert gathered.tolist() == [list(range(world))]
    rs = g.reduce_scatter(torch.arange(world * 2, dtype=torch.float32), dim=0)
    assert rs.tolist() == [float(world * (2 * rank)), float(world * (2 * rank + 1))]
    # uneven all_to_all: rank r sends (j + 1) rows of value 10*r + j to rank j
    send = [j + 1 for j in range(world)]
    rows = torch.cat([torch.full((j + 1, 2), 10.0 * rank + j) for j in range(world)])
    out = g.all_to_all(rows, send, [rank + 1] * world)
    expect = torch.cat([torch.full((rank + 1, 2), 10.0 * src + rank) for src in range(world)])
    assert torch.equal(out, expect)
    if rank == 0:
        g.send(torch.tensor([7.0, 8.0]), dst=world - 1)
    if rank == world - 1:
        assert g.recv((2,), torch.float32, src=0).tolist() == [7.0, 8.0]
    b = g.broadcast(torch.tensor([float(rank)]), src=world - 1)
    assert b.item() == world - 1
    return dict(g.calls), dict(g.bytes)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_collectives(world):
    out = run_local(_collectives, world, timeout_s=90)
    calls, nbytes = out[0]
    assert calls["all_reduce"] == 1 and calls["all_to_all"] == 1
    assert nbytes["all_reduce"] == 2 * 3 * 4
    # rank 0 sends rows to ranks 1..world-1: (2 + ... + world) rows of 2 floats
    assert nbytes["all_to_all"] == sum(range(2, world + 1)) * 2 * 4


def _async_collectives(rank, world):
    """async_op=True: every collective started, all in flight together, then waited for in
    another order than started; the results are the blocking calls' (two-batch overlap)."""
    g = Group.from_torch(name="world")
    x = torch.full((2, 3), float(rank + 1))
    send = [j + 1 for j in range(world)]
    rows = torch.cat([torch.full((j + 1, 2), 10.0 * rank + j) for j in range(world)])
    started = [g.all_reduce(x.clone(), async_op=True), g.all_gather(torch.tensor([[rank]]), dim=1, async_op=True),
               g.reduce_scatter(torch.arange(world * 2, dtype=torch.float32), dim=0, async_op=True),
               g.all_to_all(rows, send, [rank + 1] * world, async_op=True).map(lambda r: r * 2)]
    got = [p.wait() for p in reversed(started)][::-1]
    blocking = [g.all_reduce(x.clone()), g.all_gather(torch.tensor([[rank]]), dim=1),
                g.reduce_scatter(torch.arange(world * 2, dtype=torch.float32), dim=0),
                g.all_to_all(rows, send, [rank + 1] * world) * 2]
    return all(torch.equal(a, b) for a, b in zip(got, blocking)), len(got)


@pytest.mark.timeout(120)
def test_async_collectives_give_the_blocking_results():
    assert run_local(_async_collectives, 2, timeout_s=90) == [(True, 4), (True, 4)]


def test_size_one_is_noop():
    g = Group.single()
    x = torch.ones(3)
    assert g.all_reduce(x) is x and g.all_gather(x) is x
    assert g.all_to_all(x, [3], [3]) is x
    assert g.all_to_all(x, [3], [3], async_op=True).wait() is x
    assert not g.calls


def _fail_on_rank_one(rank, world):
    if rank == 1:
        raise ValueError("boom on purpose")
    Group.from_torch().barrier()  # would wait forever for rank 1
    return rank


@pytest.mark.timeout(60)
def test_failure_names_the_rank():
    with pytest.raises(RankFailure, match=r"rank 1 on \S+ failed: ValueError: boom on purpose"):
        run_local(_fail_on_rank_one, 3, timeout_s=50)


def _listening_addresses(rank, world):
    """Local addresses of this process's listening TCP sockets (Linux /proc)."""
    import os
    from pathlib import Path

    Group.from_torch().barrier()
    inodes = set()
    for fd in Path("/proc/self/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            f = line.split()
            if f[3] == "0A" and f[9] in inodes:  # 0A: LISTEN
                found.append(f[1].split(":")[0])
    return found


@pytest.mark.timeout(60)
@pytest.mark.skipif(not __import__("os").path.exists("/proc/net/tcp"), reason="reads /proc/net")
def test_ranks_listen_on_loopback_only():
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1, ::1
    addresses = run_local(_listening_addresses, 2, timeout_s=50)
    assert addresses[0], "rank 0 serves the rendezvous store, so it must listen somewhere"
    for rank, found in enumerate(addresses):
        assert set(found) <= loopback, f"rank {rank} listens on {found}"
