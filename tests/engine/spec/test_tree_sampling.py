"""The engine's sampled tree steps keep the target's distribution: DeepSeek-V3's MTP layer
drafting a tree (topk 3, one deep: three children of the pending token) on a 6-token
vocabulary; the joint distribution of the first token (plain sampling) and the second (the
first tree verify step's), with tree drafts and without, chi-square test of homogeneity. The
same test with the residual never updated after a rejection (engine.sample.tree_rule) fails."""

import pytest
from mtp_fns import with_mtp_layer
from scipy.stats import chi2_contingency

from atoll import LLM, SamplingParams
from atoll.engine.batch.request import Request
from atoll.engine.rank.loop import run_batch
from atoll.engine.rank.runner import ModelRunner
from atoll.engine.sample import tree_rule
from atoll.parallel.mesh import ParallelContext

ALPHA = 1e-3
N = 800
PROMPT = [0, 1, 2, 3, 4, 5, 0, 1]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_engine_tree_sampling_matches_plain_sampling(tiny_model, tmp_path_factory, monkeypatch):
    base = tiny_model("deepseek_v3", num_hidden_layers=2, vocab_size=6, initializer_range=0.05)
    d = with_mtp_layer(base, tmp_path_factory.mktemp("tiny-mtp-v6"))
    tree = {"method": "deepseek_mtp", "num_speculative_tokens": 1, "topk": 3}

    def joint(spec, first_seed):
        """Seeds of their own per run (a seeded draw is a function of seed and position).
        max_tokens 5: the context then leaves the first tree room for its three nodes' slots."""
        params = [SamplingParams(max_tokens=5, temperature=1.0, seed=first_seed + i, ignore_eos=True)
                  for i in range(N)]
        llm = LLM(d, max_num_seqs=N, speculative_config=spec)
        requests = [Request(i, PROMPT, p) for i, p in enumerate(params)]
        results = run_batch(ModelRunner(llm.spec(requests), ParallelContext.single()), requests)
        return [tuple(r["token_ids"][:2]) for r in results], results

    def pvalue(a, b):
        cats = sorted(set(a) | set(b))
        table = [[a.count(c) for c in cats], [b.count(c) for c in cats]]
        keep = [j for j in range(len(cats)) if table[0][j] + table[1][j] >= 10]
        return chi2_contingency([[row[j] for j in keep] for row in table]).pvalue

    plain, _ = joint(None, 0)
    spec, results = joint(tree, N)
    drafted = sum(r["metrics"]["spec_drafted"] for r in results)
    accepted = sum(r["metrics"]["spec_accepted"] for r in results)
    assert drafted >= 3 * N and 0 < accepted < drafted  # every request's first verify: a tree of three
    assert pvalue(plain, spec) > ALPHA
    monkeypatch.setattr(tree_rule, "update_residual", lambda r, q, t: r)
    wrong, _ = joint(tree, 2 * N)
    assert pvalue(plain, wrong) < ALPHA
