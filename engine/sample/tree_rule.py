"""The speculative-sampling rule for a tree of drafts: which path of the tree a sequence keeps,
from the target's distribution at every node.

A tree is given by `parents` (parents[0] = -1: the root, the sequence's pending token, already
taken) and `tokens` (tokens[i]: node i's drafted token; tokens[0] is the pending token). The
target's distribution p[i] at node i is that of the token following node i's path.

Sampled (SpecInfer's multi-draft rule, Miao et al. 2024, "multi-step speculative sampling"):
at node n with children c_1..c_m, the residual r starts as p[n]; child c_i is accepted with
probability min(1, r(x_i) / q_i(x_i)), x_i its token and q_i the distribution it was drawn
from; on its rejection r becomes max(0, r - q_i), normalised. The walk moves to the first
child accepted and repeats there; when every child is rejected the token is drawn from r; at a
leaf it is drawn from p[leaf] (the bonus). A deterministic draft (top-k of a draft model's
logits, an n-gram) has q_i the point mass on x_i: acceptance is r(x_i) and the residual is r
with x_i removed, so each emitted token is distributed exactly as p. Children drawn i.i.d. from
one q (q given per node) are SpecInfer's case.

Greedy (temperature 0): move to the child whose token equals p[n]'s argmax while there is one,
then take the argmax: the tokens plain greedy decoding gives.

Plain functions over tensors of one sequence: no ranks, no engine state.
"""

from __future__ import annotations

import torch


def children(parents: list[int]) -> list[list[int]]:
    """parents -> each node's children, in node order (the order they are tried in)."""
    out: list[list[int]] = [[] for _ in parents]
    for node, parent in enumerate(parents):
        if node and not 0 <= parent < node:
            raise ValueError(f"tree parents[{node}]={parent} must name an earlier node")
        if node:
            out[parent].append(node)
    return out


def update_residual(r: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """The residual after a child drawn from q (None: the point mass on `token`) is rejected:
    max(0, r - q), normalised (r itself when nothing is left, a rounding case)."""
    if q is None:
        out = r.clone()
        out[token] = 0.0
    else:
        out = (r - q).clamp_min(0.0)
    total = out.sum()
    return out / total if total > 0 else r


def accept_ratio(r: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """The chance a child of `token` drawn from q (None: a point mass) is kept: min(1, r/q)."""
    if q is None:
        return r[token]
    return (r[token] / q[token]).clamp(max=1.0) if q[token] > 0 else torch.zeros((), dtype=r.dtype)


def draw_rest(r: torch.Tensor, p: torch.Tensor, gen: torch.Generator | None) -> int:
    """The token taken when every child of a node was rejected (or at a leaf, where r is p):
    drawn from the residual r; p, the node's own distribution, is the wrong choice."""
    return int(torch.multinomial(r, 1, generator=gen)[0])


def walk_sampled(parents: list[int], tokens: list[int], p: torch.Tensor,
                 gen: torch.Generator | None = None, q: torch.Tensor | None = None,
                 gen_at=None) -> tuple[list[int], int]:
    """p: [nodes, vocab] the target's probabilities at each node; q: [nodes, vocab] the
    distribution node i's token was drawn from (row 0 unused), or None for deterministic
    drafts -> (the accepted nodes, root excluded, in path order; the next token, a correction
    or the bonus). Draws from `gen`, or with gen_at(depth) from the generator of the output
    position a node at that depth decides (a seeded request's draws for a position are then a
    function of its seed and that position, as in a chain: sampler.stream_seed)."""
    kids = children(parents)
    path, node = [], 0
    while True:
        r = p[node]
        moved = False
        if gen_at is not None:
            gen = gen_at(len(path))
        for child in kids[node]:
            qc = None if q is None else q[child]
            u = torch.rand((), generator=gen, device=p.device)
            if u < accept_ratio(r, qc, tokens[child]):
                path.append(child)
                node, moved = child, True
                break
            r = update_residual(r, qc, tokens[child])
        if not moved:
            return path, draw_rest(r, p[node], gen)


def walk_greedy(parents: list[int], tokens: list[int], target: list[int]) -> tuple[list[int], int]:
    """target: the target's argmax at each node -> (the accepted nodes, root excluded; the
    target's argmax after the last of them)."""
    kids = children(parents)
    path, node = [], 0
    while True:
        nxt = next((c for c in kids[node] if tokens[c] == target[node]), None)
        if nxt is None:
            return path, target[node]
        path.append(nxt)
        node = nxt
