"""Speculative verification: which drafted tokens a sequence keeps, from the target model's
logits at the K+1 positions of one verify forward (the pending token, then the K drafts).

Every drafter here is deterministic (n-gram lookup, or the argmax of a self-draft), so its
proposal distribution q is a point mass on the drafted token d. The speculative-sampling
rule (Leviathan et al. 2023; Chen et al. 2023) then reads: accept d with probability
min(1, p(d) / q(d)) = p(d); on the first rejection draw the replacement from the residual
max(0, p - q), normalised, which is p with d removed; when every draft is accepted draw one
bonus token from the last position's p. Each token so produced is distributed exactly as
plain sampling from p would draw it (p after temperature, top-k and top-p: the same
`probabilities` the plain sampler uses). With temperature 0 the rule is: keep drafts while
each equals the target's argmax, then take the target's argmax, the tokens plain greedy
decoding gives.

A row of the result is the tokens a sequence takes this step: the accepted drafts, then one
token from the target (a correction or the bonus). Past them a greedy row holds -2 - t for the
target's argmax t at each later position (what it would take there after the rejected drafts:
the next Jacobi iterate, which the lookahead drafter's pool reads), a sampled row -1; a reader
keeps the entries >= 0.
"""

from __future__ import annotations

import torch

from atoll.engine.sample.sampler import SamplerState, probabilities


def accept_probability(p: torch.Tensor, token: int) -> torch.Tensor:
    """The chance a point-mass draft of `token` is kept under the target distribution p."""
    return p[token]


def residual(p: torch.Tensor, token: int) -> torch.Tensor:
    """The distribution a rejected draft's replacement is drawn from: max(0, p - q), normalised,
    with q the point mass on `token`."""
    r = p.clone()
    r[token] = 0.0
    total = r.sum()
    return r / total if total > 0 else p  # p(token) rounded below 1 with nothing else left: p itself


def verify_greedy(logits: torch.Tensor, drafts: torch.Tensor) -> torch.Tensor:
    """logits: [seqs, K+1, vocab], drafts: [seqs, K] (-1 past a shorter draft) -> [seqs, K+1]
    tokens taken, then -2 - the target's argmax at each position past them; no host sync."""
    target = logits.argmax(-1)  # [seqs, K+1]
    match = (target[:, :-1] == drafts).long()
    accepted = match.cumprod(1).sum(1, keepdim=True)  # [seqs, 1]: leading drafts the target agrees with
    at = torch.arange(target.shape[1], device=target.device)[None, :]
    return torch.where(at <= accepted, target, -2 - target)


def verify_sampled(logits: torch.Tensor, draft: list[int], state: SamplerState,
                   position: int | None = None) -> torch.Tensor:
    """logits: [len(draft)+1, vocab] of one sequence, draft: its drafted tokens -> [len(draft)+1]
    tokens taken, -1 padded. Draws from the sequence's own generator, so a seed reproduces;
    position: the first drafted token's output index (each position's draws from its own
    stream, SamplerState.at; None: the stream as it runs)."""
    params = state.params
    out = torch.full((len(draft) + 1,), -1, dtype=torch.long, device=logits.device)
    for j, token in enumerate(draft):
        gen = state.at(None if position is None else position + j)
        p = probabilities(logits[j], params)
        u = torch.rand((), generator=gen, device=logits.device)
        if u < accept_probability(p, token):
            out[j] = token
            continue
        out[j] = torch.multinomial(residual(p, token), 1, generator=gen)[0]
        return out
    gen = state.at(None if position is None else position + len(draft))
    out[len(draft)] = torch.multinomial(probabilities(logits[len(draft)], params), 1, generator=gen)[0]
    return out
