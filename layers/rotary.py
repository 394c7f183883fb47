"""Rotary position embeddings with the scaling types of the Llama, Mistral and Qwen
families: default, linear, llama3 and yarn. Frequencies are computed in float32."""

from __future__ import annotations

import math

import torch
from torch import nn

from atoll import kernels
from atoll.errors import ConfigError

SCALING_TYPES = ("default", "linear", "llama3", "yarn")


def _default(dim: int, base: float) -> torch.Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64, device="cpu").float() / dim))


def _llama3(inv: torch.Tensor, s: dict) -> torch.Tensor:
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv
    scaled = torch.where(wavelen > low_wavelen, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(dim: int, base: float, s: dict, max_pos: int) -> tuple[torch.Tensor, float]:
    factor = s["factor"]
    old_len = s.get("original_max_position_embeddings") or max_pos
    attn = s.get("attention_factor")
    if attn is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attn = yarn_mscale(factor, s["mscale"]) / yarn_mscale(factor, s["mscale_all_dim"])
        else:
            attn = yarn_mscale(factor)
    beta_fast, beta_slow = s.get("beta_fast") or 32, s.get("beta_slow") or 1

    def correction_dim(rotations):
        return dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    lo, hi = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, dim - 1)
    if lo == hi:
        hi += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - lo) / (hi - lo)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extra = 1 - ramp
    inv = (1.0 / (factor * pos_freqs)) * (1 - extra) + (1.0 / pos_freqs) * extra
    return inv, float(attn)


def rope_frequencies(dim: int, base: float, scaling: dict | None, max_pos: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [dim/2], attention scaling) for a rope_scaling / rope_parameters dict."""
    kind = (scaling or {}).get("rope_type") or (scaling or {}).get("type") or "default"
    if kind not in SCALING_TYPES:
        raise ConfigError(f"rope scaling type {kind!r} is not supported; supported: {', '.join(SCALING_TYPES)}")
    if kind == "yarn":
        return _yarn(dim, base, scaling, max_pos)
    inv = _default(dim, base)
    if kind == "linear":
        inv = inv / scaling["factor"]
    elif kind == "llama3":
        inv = _llama3(inv, scaling)
    return inv, 1.0


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, base: float, scaling: dict | None = None, max_pos: int = 4096):
        super().__init__()
        inv, self.attention_scaling = rope_frequencies(head_dim, base, scaling, max_pos)
        # computed on the CPU as transformers does, then placed on the device being built on
        self.register_buffer("inv_freq", inv.to(torch.get_default_device()), persistent=False)
        self._memo = None  # (positions, dtype, cos, sin) of the step the layers are in

    def new_step(self) -> None:
        """A step begins whose positions may be the last step's tensor with new values (a
        static decode step's buffer): the next call computes cos and sin afresh. Eager steps
        need not call it: each has a positions tensor of its own."""
        self._memo = None

    def prime(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Compute this step's cos and sin now, before the layers run (a compiled layer then
        finds them made, as every layer after the first does); returns them."""
        memo = self._memo
        if memo is None or memo[0] is not positions or memo[1] != dtype:
            memo = self._memo = (positions, dtype, *self.cos_sin(positions, dtype))
        return memo[2], memo[3]

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [tokens, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)
        return (emb.cos() * self.attention_scaling).to(dtype), (emb.sin() * self.attention_scaling).to(dtype)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q: [tokens, heads, head_dim], k: [tokens, kv_heads, head_dim]."""
        memo = self._memo
        if memo is None or memo[0] is not positions or memo[1] != q.dtype:  # once per step (see new_step)
            memo = self._memo = (positions, q.dtype, *self.cos_sin(positions, q.dtype))
        kernels.rotary_(q, k, memo[2], memo[3])  # in place: Triton on CUDA, else the torch reference
        return q, k
