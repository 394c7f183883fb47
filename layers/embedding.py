"""Vocabulary-parallel embedding and LM head. The vocabulary is padded up to a multiple
of tp; padded rows are zero in the embedding and cut from the gathered logits."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from atoll.comm.group import Group
from atoll.layers.linear import _param
from atoll.layers.packed import Packs, linear


class _VocabShard(nn.Module):
    def __init__(self, vocab_size: int, hidden: int, group: Group, dtype=None):
        super().__init__()
        self.group = group
        self.vocab_size = vocab_size
        self.per_rank = -(-vocab_size // group.size)  # ceil
        self.start = group.rank * self.per_rank
        self.stop = min(self.start + self.per_rank, vocab_size)  # real rows held
        self.weight = _param(self.per_rank, hidden, dtype=dtype)
        self.weight.weight_loader = self._load
        self.weight.data.zero_()
        self.register_buffer("weight_scale", None)  # the LM head's int8 per-row scales (layers.quant_linear)

    def _load(self, param, src, shard=None):
        param.data.zero_()
        n = max(0, self.stop - self.start)
        if n:
            param.data[:n].copy_(src[self.start:self.stop])


class VocabParallelEmbedding(_VocabShard):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.group.size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [tokens, hidden]
        out.masked_fill_(outside.unsqueeze(-1), 0.0)
        return self.group.all_reduce(out)


class ParallelLMHead(_VocabShard):
    def __init__(self, vocab_size: int, hidden: int, group: Group, dtype=None):
        super().__init__(vocab_size, hidden, group, dtype=dtype)
        self.packs = Packs()  # its weight's packed copies (layers.packed), tied or not

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        logits = linear(x, self.weight, scale=self.weight_scale, packs=self.packs)  # [tokens, vocab/tp (padded)]
        return self.group.all_gather(logits, dim=-1)[..., : self.vocab_size]  # [tokens, vocab]
