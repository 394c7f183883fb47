"""fused_moe: the routed experts of one MoE layer in one call, for layers/moe.py.

    y = fused_moe(x, w13, w2, topk_ids, topk_weights, expert_offset=first_local_expert)

    x:            [tokens, hidden]
    w13:          [experts_local, 2*inter, hidden]  rows [gate; up], gate first, F.linear's
                  [out, in] layout (transformers' MixtralExperts.gate_up_proj is exactly this)
    w2:           [experts_local, hidden, inter]    (MixtralExperts.down_proj)
    topk_ids:     [tokens, top_k] GLOBAL expert ids; local expert e is global e + expert_offset
    topk_weights: [tokens, top_k] routing weights (any float dtype; used in float32)
    returns       [tokens, hidden] in x's dtype:
                  sum over slots j with a local expert of w[t,j] * down(silu(gate(x)) * up(x))

Slots whose expert is not local (another EP rank's, or a negative id) contribute nothing, so
under expert parallelism each rank can call this on the same tokens and the partial sums add
up (or call it on the rows the Dispatcher delivered: ids = each row's expert as [rows, 1],
weights = ones, and let combine apply the weights).

On the Triton path this is four launch groups: moe_align (3 small launches), grouped_gemm with
the fused SiLU-and-multiply, grouped_gemm with the routing weight, unpermute_reduce. On the
torch path it is reference.fused_moe, a loop over the experts that have tokens.
"""

from __future__ import annotations

import torch

from atoll.kernels import reference
from atoll.kernels.backend import check, use_triton
from atoll.kernels.configs import MoeConfig, moe_config


def check_moe_shapes(x, w13, w2, topk_ids, topk_weights) -> tuple[int, int, int, int]:
    """(tokens, hidden, experts, inter) once the experts' and the routing's shapes agree (KernelError naming the
    tensor otherwise): x [tokens, hidden], w13 [experts, 2*inter, hidden], w2 [experts, hidden,
    inter], topk_ids and topk_weights [tokens, top_k]."""
    tokens, hidden = x.shape
    check(w13.dim() == 3 and w2.dim() == 3, f"w13 and w2 must be 3-D, got {w13.dim()}-D and {w2.dim()}-D")
    experts, two_inter, _ = w13.shape
    inter = two_inter // 2
    check(tuple(w13.shape) == (experts, 2 * inter, hidden),
          f"w13 must be [experts, 2*inter, hidden={hidden}], got {tuple(w13.shape)}")
    check(tuple(w2.shape) == (experts, hidden, inter),
          f"w2 must be [experts={experts}, hidden={hidden}, inter={inter}], got {tuple(w2.shape)}")
    check(topk_ids.dim() == 2 and topk_ids.shape[0] == tokens,
          f"topk_ids must be [tokens={tokens}, top_k], got {tuple(topk_ids.shape)}")
    check(topk_weights.shape == topk_ids.shape,
          f"topk_weights {tuple(topk_weights.shape)} must match topk_ids {tuple(topk_ids.shape)}")
    return tokens, hidden, experts, inter


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_ids: torch.Tensor,
              topk_weights: torch.Tensor, *, expert_offset: int = 0,
              config: MoeConfig | None = None) -> torch.Tensor:
    check(x.dim() == 2, f"x must be [tokens, hidden], got shape {tuple(x.shape)}")
    tokens, hidden, experts, inter = check_moe_shapes(x, w13, w2, topk_ids, topk_weights)
    check(x.dtype == w13.dtype == w2.dtype, f"x, w13 and w2 must share a dtype, got {x.dtype}, {w13.dtype}, {w2.dtype}")
    if tokens == 0:
        return x.new_zeros(0, hidden)
    if not use_triton(x, w13, w2, topk_ids, topk_weights):
        return reference.fused_moe(x, w13, w2, topk_ids, topk_weights, expert_offset=expert_offset)

    from atoll.kernels.triton_grouped_gemm import grouped_gemm
    from atoll.kernels.triton_moe_align import moe_align
    from atoll.kernels.triton_unpermute import unpermute_reduce

    top_k = topk_ids.shape[1]
    cfg = config or moe_config(tokens, top_k, experts)
    align = moe_align(topk_ids, experts, cfg.block_m, expert_offset=expert_offset)
    h = grouped_gemm(x, w13, align, gather=True, silu_mul=True, config=cfg.gemm1)  # [max_rows, inter]
    y = grouped_gemm(h, w2, align, weights=topk_weights, config=cfg.gemm2)        # [max_rows, hidden]
    return unpermute_reduce(y, align)                                             # [tokens, hidden]
