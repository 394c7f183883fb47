import torch.nn.functional as F
from torch import nn

from atoll.comm.group import Group
from atoll.layers.linear import MergedColumnParallelLinear, RowParallelLinear


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)), gate/up column-parallel and down row-parallel over `group`."""

    def __init__(self, hidden: int, inter: int, group: Group, *, dtype=None):
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], group, dtype=dtype)
        self.down_proj = RowParallelLinear(inter, hidden, group, dtype=dtype)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # [tokens, inter/tp] each
        return self.down_proj(F.silu(gate) * up)  # [tokens, hidden], summed over the group
