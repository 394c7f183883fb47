"""The tree speculative-sampling rule (engine.sample.tree_rule): the first token a tree step
emits, and the second given the first, follow the target's distribution (chi-square goodness
of fit, seeded), for deterministic drafts and for children drawn i.i.d. from a draft
distribution; the same test fails under wrong rules; greedy walks the argmax path."""

import pytest
import torch
from scipy.stats import chisquare

from atoll.engine.sample import tree_rule
from atoll.engine.sample.tree_rule import children, walk_greedy, walk_sampled

VOCAB = 6
TRIALS = 3000
ALPHA = 1e-3  # the p-value below which a test says "not the target's distribution"
# root (pending token) with three children; the first child has two children of its own
PARENTS = [-1, 0, 0, 0, 1, 1]


def _dists():
    g = torch.Generator().manual_seed(5)
    p = torch.softmax(torch.randn(len(PARENTS), VOCAB, generator=g) * 1.5, -1).double()
    q = torch.softmax(torch.randn(len(PARENTS), VOCAB, generator=g), -1).double()
    return p, q


def _tokens(p):
    """Deterministic drafts: the root's children are its three likeliest tokens (so acceptance
    is common), node 1's children its two likeliest."""
    top0 = p[0].argsort(descending=True).tolist()
    top1 = p[1].argsort(descending=True).tolist()
    return [0, top0[0], top0[1], top0[2], top1[0], top1[1]]


def _emitted(stochastic: bool):
    """TRIALS tree steps: the first token emitted, and the second where the first was node 1's
    token through node 1 (then it is drawn from p[1])."""
    p, q = _dists()
    gen = torch.Generator().manual_seed(11)
    first, second = [], []
    tokens = _tokens(p)
    for _ in range(TRIALS):
        if stochastic:  # each node's children drawn i.i.d. from the draft's q at their parent
            tokens = [0] + [int(torch.multinomial(q[parent], 1, generator=gen)[0]) for parent in PARENTS[1:]]
        qs = q[PARENTS].clone() if stochastic else None  # row i: the distribution node i came from
        path, nxt = walk_sampled(PARENTS, tokens, p, gen, qs)
        out = [tokens[n] for n in path] + [nxt]
        first.append(out[0])
        if path[:1] == [1]:
            second.append(out[1])
    return p, first, second


def _pvalues(stochastic: bool):
    p, first, second = _emitted(stochastic)
    out = []
    for row, drawn in ((0, first), (1, second)):
        counts = torch.bincount(torch.tensor(drawn), minlength=VOCAB).double()
        assert counts.sum() > 300  # enough draws for the test to mean something
        out.append(chisquare(counts.numpy(), (p[row] / p[row].sum() * counts.sum()).numpy()).pvalue)
    return out


@pytest.mark.parametrize("stochastic", [False, True], ids=["top_k_drafts", "sampled_drafts"])
def test_tree_sampling_keeps_the_target_distribution(stochastic):
    assert min(_pvalues(stochastic)) > ALPHA


@pytest.mark.parametrize("wrong", ["no_residual_update", "accept_always", "draw_from_p"])
@pytest.mark.parametrize("stochastic", [False, True], ids=["top_k_drafts", "sampled_drafts"])
def test_the_tree_test_bites(monkeypatch, wrong, stochastic):
    """The same test under a wrong rule rejects at the same threshold: the residual never
    updated after a rejection; every first child accepted; or, on
    all children rejected, the token drawn from p instead of the residual."""
    if wrong == "no_residual_update":
        monkeypatch.setattr(tree_rule, "update_residual", lambda r, q, t: r)
    elif wrong == "accept_always":
        monkeypatch.setattr(tree_rule, "accept_ratio", lambda r, q, t: torch.tensor(1.0))
    else:
        monkeypatch.setattr(tree_rule, "draw_rest", lambda r, p, gen: int(torch.multinomial(p, 1, generator=gen)[0]))
    assert min(_pvalues(stochastic)) < ALPHA


def test_greedy_walks_the_argmax_path():
    tokens = [9, 3, 4, 5, 7, 8]
    # the target's argmax at each node: 4 after the root (node 2, a leaf) -> then 6
    target = [4, 0, 6, 0, 0, 0]
    assert walk_greedy(PARENTS, tokens, target) == ([2], 6)
    # through node 1 then node 5, then node 5's argmax
    assert walk_greedy(PARENTS, tokens, [3, 8, 0, 0, 0, 2]) == ([1, 5], 2)
    # no child matches: the root's argmax
    assert walk_greedy(PARENTS, tokens, [1, 0, 0, 0, 0, 0]) == ([], 1)


def test_parents_must_name_earlier_nodes():
    assert children(PARENTS) == [[1, 2, 3], [4, 5], [], [], [], []]
    with pytest.raises(ValueError, match=r"parents\[2\]=2"):
        children([-1, 0, 2])


def test_a_seeded_walk_draws_each_position_from_its_own_stream():
    """Root children [a, b]: a is rejected for sure (the target gives its token no mass), b
    accepted for sure; below b the bonus token is drawn. Drawn per position, the bonus is the
    same as in the tree whose root has b alone (the draws at depth 0 do not shift depth 1's);
    drawn from one generator in turn, the extra draw for a moves it."""
    g = torch.Generator().manual_seed(3)
    p = torch.softmax(torch.randn(3, VOCAB, generator=g), -1).double()
    p[0] = 0.0
    p[0, 4] = 1.0  # the root's target: token 4 only, so a (token 2) is rejected and b (4) kept

    two = ([-1, 0, 0], [0, 2, 4], p)  # root -> a, b
    one = ([-1, 0], [0, 4], p[[0, 2]])  # root -> b
    bonus_two = set()
    for trial in range(20):
        def at(d, t=trial):
            return torch.Generator().manual_seed(1000 * t + d)
        path2, nxt2 = walk_sampled(two[0], two[1], two[2], gen_at=at)
        path1, nxt1 = walk_sampled(one[0], one[1], one[2], gen_at=at)
        assert path2 == [2] and path1 == [1]
        assert nxt2 == nxt1
        bonus_two.add(nxt2)
    assert len(bonus_two) > 1  # the bonus is drawn, not fixed
    shifted = sum(walk_sampled(two[0], two[1], two[2], gen=torch.Generator().manual_seed(t))[1]
                  != walk_sampled(one[0], one[1], one[2], gen=torch.Generator().manual_seed(t))[1]
                  for t in range(20))
    assert shifted > 0  # one generator in turn: the rejected sibling's draw moves the bonus
