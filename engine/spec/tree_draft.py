"""Drafting a tree from a recurrent drafter (an EAGLE-3 head, DeepSeek-V3's MTP layer): the
expansion EAGLE-2 and SGLang use for `topk` > 1.

From the drafter's state at the sequence's last cached position (the root), each depth takes
the `topk` likeliest tokens after every node of the frontier, scores each by its path's
log-probability under the drafter, and keeps the `topk` best as the next frontier: `topk`
nodes per depth, `depth` deep, at most `budget` nodes in all. The drafter runs node i's row
in its own cache at slot root + i (root: the position of its state, cached - 1) under the
tree mask (engine.sample.tree.rows_meta), at position root + depth(i), so siblings never read
each other's keys.
"""

from __future__ import annotations

import torch

from atoll.engine.sample.tree import rows_meta


def draft_trees(wants, ready: dict, **kw) -> list[tuple[list[int], list[int]]]:
    """[(sequence, depth, nodes)] -> each sequence's tree (draft_tree, kw its arguments), from
    the drafter's state at the sequence's last cached position (ready[seq]: (cached, state));
    no tree for a sequence whose state is not at its last cached position."""
    out = []
    for seq, depth, nodes in wants:
        state = ready.get(seq)
        if not state or state[0] != seq.cached:
            out.append(([], [-1]))
            continue
        out.append(draft_tree(seq, depth, nodes, state[1], **kw))
    return out


def draft_tree(seq, depth: int, budget: int, root: torch.Tensor, *, topk: int, logits, step, to_target=None,
               block_size: int, device) -> tuple[list[int], list[int]]:
    """root: [H] the drafter's state at seq.cached - 1; logits(h [n, H]) -> [n, V] the
    drafter's logits; step(ids [n], h [n, H], meta) -> [n, H] its states after those tokens;
    to_target: its token ids as the target's (None: the same vocabulary) -> (the drafted
    tokens, the parent of each of [pending token] + tokens, -1 first)."""
    tokens, parents, scores = [seq.tokens[-1]], [-1], [0.0]
    states, frontier = {0: root}, [0]
    for d in range(depth):
        logp = torch.log_softmax(logits(torch.stack([states[n] for n in frontier])).float(), -1)
        top = logp.topk(min(topk, logp.shape[-1]), -1)
        cands = sorted(((scores[n] + v, n, t) for n, vs, ts in zip(frontier, top.values.tolist(), top.indices.tolist())
                        for v, t in zip(vs, ts)), key=lambda x: -x[0])[:min(topk, budget - (len(tokens) - 1))]
        ids = [t for _, _, t in cands]
        new = []
        for (score, parent, _), token in zip(cands, to_target(ids) if to_target is not None else ids):
            tokens.append(token)
            parents.append(parent)
            scores.append(score)
            new.append(len(tokens) - 1)
        if d == depth - 1 or len(tokens) - 1 >= budget:
            break
        meta = rows_meta([(seq.blocks, seq.cached - 1, parents, new)], block_size, device=device)
        h = step(torch.tensor([tokens[n] for n in new], dtype=torch.long, device=device),
                 torch.stack([states[parents[n]] for n in new]), meta)
        states.update(zip(new, h))
        frontier = new
    return tokens[1:], parents
