"""MoE routers, replicated on every rank: they pick each token's top-k experts.

softmax: Mixtral / Qwen2-MoE / Qwen3-MoE / DeepSeek-V2 (top-k of softmax probabilities,
optionally renormalised; V2's optionally group-limited, groups ranked by their best expert,
and scaled). sigmoid: DeepSeek-V3 (sigmoid scores, a score-correction bias used only for
choosing, group-limited top-k, renormalisation and a routed scaling factor).
Weights come back in float32, as transformers computes them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atoll.layers.linear import _param, copy_into


class Router(nn.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, *, scoring: str = "softmax",
                 renormalize: bool = True, n_group: int = 1, topk_group: int = 1,
                 scaling: float = 1.0, dtype=None):
        super().__init__()
        if num_experts % n_group:
            raise ValueError(f"n_group={n_group} does not divide num_experts={num_experts}")
        self.num_experts, self.top_k = num_experts, top_k
        self.scoring, self.renormalize = scoring, renormalize
        self.n_group, self.topk_group, self.scaling = n_group, topk_group, scaling
        self.weight = _param(num_experts, hidden, dtype=torch.float32 if scoring == "sigmoid" else dtype)
        self.weight.weight_loader = lambda p, src, shard=None: copy_into(p.data, src[:])
        if scoring == "sigmoid":
            self.e_score_correction_bias = _param(num_experts, dtype=torch.float32)
            self.e_score_correction_bias.weight_loader = self.weight.weight_loader

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x: [tokens, hidden] -> (ids [tokens, k] long, weights [tokens, k] float32)."""
        if self.scoring == "softmax":
            probs = F.softmax(F.linear(x, self.weight).float(), dim=-1)
            if self.n_group > 1:  # DeepSeek-V2's group_limited_greedy: groups ranked by their best expert
                grouped = probs.view(len(x), self.n_group, self.num_experts // self.n_group)
                best = torch.topk(grouped.amax(dim=-1), self.topk_group, dim=-1, sorted=False)[1]
                keep = torch.zeros(len(x), self.n_group, dtype=torch.bool, device=x.device).scatter_(1, best, True)
                probs = probs.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), 0.0)
            weights, ids = torch.topk(probs, self.top_k, dim=-1)
            if self.renormalize:
                weights = weights / weights.sum(dim=-1, keepdim=True)
            return ids, weights if self.scaling == 1.0 else weights * self.scaling
        scores = F.linear(x.float(), self.weight).sigmoid()  # [tokens, experts]
        choice = scores + self.e_score_correction_bias
        if self.n_group > 1:
            grouped = choice.view(len(x), self.n_group, self.num_experts // self.n_group)
            group_scores = grouped.topk(min(2, grouped.shape[-1]), dim=-1)[0].sum(dim=-1)
            best = torch.topk(group_scores, self.topk_group, dim=-1, sorted=False)[1]
            keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, best, True)
            choice = choice.masked_fill(~keep.repeat_interleave(grouped.shape[-1], dim=1), float("-inf"))
        ids = torch.topk(choice, self.top_k, dim=-1, sorted=False)[1]
        weights = scores.gather(1, ids)
        if self.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        return ids, weights * self.scaling
