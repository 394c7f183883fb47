"""Another engine using atoll's layers and MoE dispatcher inside its own runtime.

The engine starts torch.distributed and makes its own process groups; atoll only wraps
them (Group.from_torch) and never creates groups or reads global state.

    torchrun --nproc-per-node 4 --master-addr 127.0.0.1 examples/own_process_groups.py

Each rank checks a tensor-parallel MLP (2 ranks per TP group) against the unsharded math
and runs one MoE dispatch/combine over all 4 ranks, then prints "rank R ok".
"""

import os

import torch
import torch.distributed as dist
import torch.nn.functional as F

from atoll.comm import Group
from atoll.comm.dispatch import Dispatcher
from atoll.layers.linear import ColumnParallelLinear, RowParallelLinear


def main() -> None:
    dist.init_process_group("gloo")  # the engine's own bootstrap (torchrun's env://)
    rank, world = dist.get_rank(), dist.get_world_size()
    # the engine's own TP groups: {0,1}, {2,3}
    pairs = [dist.new_group([r, r + 1]) for r in range(0, world, 2)]
    tp = Group.from_torch(pairs[rank // 2], name="engine-tp")
    everyone = Group.from_torch(None, name="engine-world")

    g = torch.Generator().manual_seed(0)  # same full weights on every rank
    w_up, w_down = torch.randn(64, 32, generator=g), torch.randn(32, 64, generator=g)
    x = torch.randn(5, 32, generator=g)
    up = ColumnParallelLinear(32, 64, tp)
    down = RowParallelLinear(64, 32, tp)
    up.weight.weight_loader(up.weight, w_up)  # each rank keeps only its slice
    down.weight.weight_loader(down.weight, w_down)
    y = down(F.silu(up(x)))
    assert torch.allclose(y, F.linear(F.silu(F.linear(x, w_up)), w_down), atol=1e-4)

    # MoE: 8 experts over the 4 ranks; identity experts, so combine returns x * sum(weights)
    dispatcher = Dispatcher(everyone, num_experts=8)
    tokens = torch.randn(6, 32, generator=torch.Generator().manual_seed(rank))
    ids = torch.randint(0, 8, (6, 2), generator=torch.Generator().manual_seed(rank))
    weights = torch.rand(6, 2, generator=torch.Generator().manual_seed(rank))
    d = dispatcher.dispatch(tokens, ids, weights)
    out = dispatcher.combine(d.rows, d)
    assert torch.allclose(out, tokens * weights.sum(-1, keepdim=True), atol=1e-5)
    print(f"rank {rank} ok: TP MLP matches, dispatch moved {sum(dispatcher.bytes.values())} bytes")
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    main()
