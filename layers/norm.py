import torch
from torch import nn

from atoll import kernels

from atoll.layers.linear import _param, copy_into


class RMSNorm(nn.Module):
    """RMSNorm computed in float32 and cast back, as the Llama family defines it."""

    def __init__(self, dim: int, eps: float = 1e-6, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = _param(dim, dtype=dtype)
        self.weight.data.fill_(1.0)
        self.weight.weight_loader = lambda p, src, shard=None: copy_into(p.data, src[:])

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None) -> torch.Tensor:
        """norm(x), or with residual norm(x + residual), the sum written into residual."""
        return kernels.rms_norm(x, self.weight, self.eps, residual=residual)  # Triton on CUDA, else torch
