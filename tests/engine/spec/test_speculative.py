"""Speculative decoding (engine.spec.registry, engine.sample.verify): greedy tokens identical to
transformers with n-gram drafts at TP1, TP2, PP2, EP2 and DP2EP2, and with layer-skip and
draft-model drafts at TP1 and TP2; every block back in the
pool after many rejections and the prefix cache's hits unchanged; the speculative-sampling
rule keeps the target's distribution (chi-square tests, shown to fail under a wrong rule);
seeded sampling reproducible; bad configs refused in one line."""

import pytest
import torch
from reference import reference_tokens
from scipy.stats import chi2_contingency, chisquare

from atoll import LLM, SamplingParams
from atoll.config import EngineConfig
from atoll.engine.sample import verify
from atoll.engine.spec.ngram import ngram_lookup
from atoll.engine.batch.request import Request
from atoll.engine.rank.loop import run_batch
from atoll.engine.rank.runner import ModelRunner
from atoll.engine.sample.sampler import SamplerState, probabilities
from atoll.errors import InputError
from atoll.parallel.mesh import ParallelContext

# repeated runs in the prompts give the n-gram drafter something to find (and the random
# model mostly rejects it); 32 new tokens with K=3 mix acceptances and rejections
PROMPTS = [[5, 7, 9, 11, 13] * 3, [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8] * 2, [250]]
NEW = 32
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
SKIP = {"method": "layer_skip", "num_speculative_tokens": 3, "num_layers": 2}
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)


@pytest.fixture(scope="module")
def dense(tiny_model):
    d = tiny_model("llama", num_hidden_layers=4)
    return d, reference_tokens(d, PROMPTS, NEW)


def _in_process(model_dir, prompts, params, **options):
    """One rank in this process (so a test can patch the rule); the results and the runner."""
    llm = LLM(model_dir, **options)
    requests = llm.prepare(prompts, params)
    runner = ModelRunner(llm.spec(requests), ParallelContext.single())
    return run_batch(runner, requests), runner


def _spec_counts(outs):
    m = [o.metrics if hasattr(o, "metrics") else o["metrics"] for o in outs]
    return sum(x["spec_drafted"] for x in m), sum(x["spec_accepted"] for x in m)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", [NGRAM, SKIP], ids=["ngram", "layer_skip"])
def test_greedy_tp1_in_process(dense, method):
    model_dir, expected = dense
    results, runner = _in_process(model_dir, PROMPTS, GREEDY, speculative_config=method, block_size=4)
    assert [r["token_ids"] for r in results] == expected
    drafted, accepted = _spec_counts(results)
    assert 0 < accepted < drafted  # both acceptances and rejections happened
    assert runner.stats["blocks_held"] == 0  # rejected drafts' blocks came back


def _compiled_in_process(dense, monkeypatch, tmp_path, *, max_num_seqs):
    """n-gram speculation through the compiled CPU step, one rank in this process; asserts
    transformers' tokens, returns (results, runner)."""
    torch._dynamo.reset()  # this process's earlier compiles of the same layer code would change the counts
    monkeypatch.delenv("ATOLL_ENFORCE_EAGER", raising=False)
    monkeypatch.setenv("ATOLL_CACHE", str(tmp_path))
    model_dir, expected = dense
    results, runner = _in_process(model_dir, PROMPTS, GREEDY, speculative_config=NGRAM, block_size=4,
                                  max_num_seqs=max_num_seqs, compile="always")
    assert [r["token_ids"] for r in results] == expected
    return results, runner


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_verify_steps_run_in_the_compiled_decode_step(dense, monkeypatch, tmp_path):
    """CPU compiled step: a verify step's rows (4 sequences x (1 + 3 drafts)) run in its graph,
    at buckets up to max_num_seqs x (1 + K), with transformers' tokens."""
    results, runner = _compiled_in_process(dense, monkeypatch, tmp_path, max_num_seqs=4)
    drafted, accepted = _spec_counts(results)
    assert 0 < accepted < drafted
    step = runner.decode_step
    assert step.buckets == [2, 4, 8, 16] and max(step.buckets_run) > 4  # more rows than sequences: verify steps
    assert len(step.compiles) == 1 and runner.stats["blocks_held"] == 0


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_one_sequence_keeps_its_one_row_graph_beside_the_verify_graph(dense, monkeypatch, tmp_path):
    """max_num_seqs 1 with speculation: plain steps run the static one-row graph, verify steps
    (1 + K rows) the shared one; transformers' tokens for each prompt."""
    results, runner = _compiled_in_process(dense, monkeypatch, tmp_path, max_num_seqs=1)
    step = runner.decode_step
    assert step.buckets == [1, 2, 4] and 1 in step.buckets_run and max(step.buckets_run) > 1
    assert {rows > 1 for rows, _ in step.compiles} == {False, True} and step.warm_rows == (1, 2)  # both graphs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout,method", [("TP2", NGRAM), ("PP2", NGRAM), ("TP2", SKIP)],
                         ids=["TP2-ngram", "PP2-ngram", "TP2-layer_skip"])
def test_greedy_matches_transformers(dense, layout, method):
    model_dir, expected = dense
    outs = LLM(model_dir, layout=layout, speculative_config=method).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    drafted, accepted = _spec_counts(outs)
    assert 0 < accepted < drafted


@pytest.mark.timeout(300)
def test_prefix_cache_hits_unchanged(dense):
    """A later request whose prompt is an earlier one's prompt and output finds as many cached
    tokens with speculation as without: drafts never name a block, accepted tokens do."""
    model_dir, expected = dense
    first = PROMPTS[2]
    later = first + expected[2][:21] + [3]
    params = SamplingParams(max_tokens=8, ignore_eos=True)

    def hits(spec):
        llm = LLM(model_dir, block_size=4, speculative_config=spec)
        reqs = [Request(0, first, GREEDY), Request(1, later, params, arrival_step=60)]
        runner = ModelRunner(llm.spec(reqs), ParallelContext.single())
        results = run_batch(runner, reqs)
        assert runner.stats["blocks_held"] == 0
        return [r["metrics"]["cached_tokens"] for r in results], results

    (on, r_on), (off, r_off) = hits(NGRAM), hits(None)
    assert on == off and on[1] >= 36
    assert [r["token_ids"] for r in r_on] == [r["token_ids"] for r in r_off]


def test_ngram_lookup_takes_the_latest_longest_match():
    assert ngram_lookup([1, 2, 3, 9, 1, 2, 3, 8, 1, 2, 3], 1, 3, 2) == [8, 1]
    assert ngram_lookup([4, 5, 6, 4, 5], 2, 2, 3) == [6, 4, 5]
    assert ngram_lookup([1, 2, 3], 1, 3, 2) == []


# --- the sampling rule ---------------------------------------------------------------------
VOCAB = 5
SAMPLES = 6000
ALPHA = 1e-3  # the p-value below which a test says "not the target's distribution"


def _logits():
    g = torch.Generator().manual_seed(3)
    return torch.randn(3, VOCAB, generator=g) * 1.5  # positions 0, 1 and the bonus position


def _draws(params, draft=(1, 2)):
    """SAMPLES verify steps over fixed logits: the first token taken, and the second where the
    first was the draft's (then it is drawn from position 1's distribution)."""
    logits = _logits()
    state = SamplerState(SamplingParams(**params, seed=11))
    first, second = [], []
    for _ in range(SAMPLES):
        out = verify.verify_sampled(logits, list(draft), state).tolist()
        first.append(out[0])
        if out[0] == draft[0] and out[1] >= 0:  # (a wrong rule may draw the rejected draft again)
            second.append(out[1])
    return logits, first, second


def _pvalues(params):
    logits, first, second = _draws(params)
    sp = SamplingParams(**params)
    out = []
    for row, drawn in ((0, first), (1, second)):
        p = probabilities(logits[row], sp).double()
        counts = torch.bincount(torch.tensor(drawn), minlength=VOCAB).double()
        keep = p > 0
        assert counts[~keep].sum() == 0  # never a token top-k / top-p removed
        out.append(chisquare(counts[keep].numpy(), (p[keep] / p[keep].sum() * counts.sum()).numpy()).pvalue)
    return out


@pytest.mark.parametrize("params", [dict(temperature=1.0), dict(temperature=0.7, top_k=3),
                                    dict(temperature=1.3, top_p=0.8)], ids=["t1", "topk", "topp"])
def test_rejection_sampling_keeps_the_target_distribution(params):
    """Chi-square goodness of fit, SAMPLES draws, threshold ALPHA, for the token taken at the
    first drafted position and at the second."""
    assert min(_pvalues(params)) > ALPHA


@pytest.mark.parametrize("wrong", ["accept_always", "sqrt_accept", "residual_keeps_draft"])
def test_the_distribution_test_bites(monkeypatch, wrong):
    """The same test with acceptance computed wrongly rejects at the same threshold."""
    if wrong == "accept_always":
        monkeypatch.setattr(verify, "accept_probability", lambda p, t: torch.tensor(1.0))
    elif wrong == "sqrt_accept":
        monkeypatch.setattr(verify, "accept_probability", lambda p, t: p[t].sqrt())
    else:
        monkeypatch.setattr(verify, "residual", lambda p, t: p)
    assert min(_pvalues(dict(temperature=1.0))) < ALPHA


@pytest.mark.timeout(300)
def test_engine_sampling_matches_plain_sampling(tiny_model, monkeypatch):
    """A 6-token-vocabulary model, every token in the prompt so the n-gram drafter always
    drafts: the joint distribution of the first token (plain sampling) and the second (the
    first verify step's), with speculation and without, 800 seeded requests each; chi-square
    test of homogeneity at ALPHA. The same test under a wrong rule (a rejected draft may be
    drawn again) fails."""
    d = tiny_model("llama", vocab_size=6, num_hidden_layers=2, initializer_range=0.05)
    prompt = [0, 1, 2, 3, 4, 5, 0, 1, 2, 3, 4, 5]
    n = 800
    def joint(spec, first_seed=0):
        """Seeds of their own per run: a seeded draw is a function of the seed and the position
        (engine.sample.sampler.stream_seed), so runs sharing seeds would not be independent samples."""
        reqs = [SamplingParams(max_tokens=3, temperature=1.0, seed=first_seed + i, ignore_eos=True) for i in range(n)]
        llm = LLM(d, max_num_seqs=n, speculative_config=spec)
        requests = [Request(i, prompt, p) for i, p in enumerate(reqs)]
        runner = ModelRunner(llm.spec(requests), ParallelContext.single())
        results = run_batch(runner, requests)
        return [tuple(r["token_ids"][:2]) for r in results], results

    def pvalue(a, b):
        cats = sorted(set(a) | set(b))
        table = [[a.count(c) for c in cats], [b.count(c) for c in cats]]
        keep = [j for j in range(len(cats)) if table[0][j] + table[1][j] >= 10]
        return chi2_contingency([[row[j] for j in keep] for row in table]).pvalue

    plain, _ = joint(None)
    spec, results = joint(dict(NGRAM, num_speculative_tokens=1), first_seed=n)
    assert _spec_counts(results)[0] == n  # every request drafted once
    assert pvalue(plain, spec) > ALPHA
    monkeypatch.setattr(verify, "residual", lambda p, t: p)
    wrong, _ = joint(dict(NGRAM, num_speculative_tokens=1), first_seed=2 * n)
    assert pvalue(plain, wrong) < ALPHA


@pytest.mark.timeout(300)
def test_seeded_sampling_reproducible(dense):
    model_dir, _ = dense
    params = SamplingParams(max_tokens=16, temperature=0.8, top_k=50, seed=5, ignore_eos=True)
    a, _ = _in_process(model_dir, PROMPTS[:2], params, speculative_config=NGRAM)
    b, _ = _in_process(model_dir, PROMPTS[:2], params, speculative_config=NGRAM)
    assert [r["token_ids"] for r in a] == [r["token_ids"] for r in b]


def test_disable_by_batch_size(dense):
    model_dir, expected = dense
    off = dict(NGRAM, disable_by_batch_size=4)  # 4 prompts: never drafts
    results, _ = _in_process(model_dir, PROMPTS, GREEDY, speculative_config=off)
    assert [r["token_ids"] for r in results] == expected
    assert _spec_counts(results) == (0, 0)


@pytest.mark.parametrize("bad,says", [
    ('{"method": "medusa2"}', "unknown speculative method"),
    ('{"method": "ngram", "num_speculative_tokens": 0}', "num_speculative_tokens=0"),
    ('{"method": "ngram", "prompt_lookup_min": 4, "prompt_lookup_max": 2}', "prompt_lookup_min=4"),
    ('{"method": "ngram", "k": 3}', "unknown key 'k'"),
    ('{"method": "draft_model"}', "goes with method draft_model"),
    ('{"method": "ngram", "model": "/some/draft"}', "goes with method draft_model"),
    ('{"method": "eagle"}', "not built yet"),
    ("ngram", "not JSON"),
])
def test_bad_config_one_line(bad, says):
    with pytest.raises(InputError, match=says) as e:
        EngineConfig(speculative_config=bad)
    assert "\n" not in str(e.value)


@pytest.mark.timeout(400)
@pytest.mark.parametrize("layout", ["EP2", "DP2EP2"])
def test_greedy_moe(tiny_model, layout):
    """Qwen3-MoE with n-gram speculation: EP2 (TP attention) and DP2EP2 (each DP replica
    verifies its own sequences; the tokens come back K+1 wide through the DP exchange)."""
    d = tiny_model("qwen3_moe")
    expected = reference_tokens(d, PROMPTS, NEW)
    outs = LLM(d, layout=layout, speculative_config=NGRAM).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    drafted, accepted = _spec_counts(outs)
    assert 0 < accepted < drafted


def test_cli_refuses_in_one_line(capsys, tiny_model):
    from test_cli_errors import _fails

    d = str(tiny_model("llama", num_hidden_layers=4))
    _fails(capsys, ["generate", "--model", d, "--prompt", "x", "--speculative-config", '{"method": "eagle9"}'],
           "unknown speculative method 'eagle9'")
    _fails(capsys, ["generate", "--model", d, "--prompt", "x", "-pp", "2", "--speculative-config",
                    '{"method": "layer_skip"}'], "layer_skip runs on one pipeline stage")
    _fails(capsys, ["generate", "--model", d, "--prompt", "x", "--speculative-config",
                    '{"method": "layer_skip", "num_layers": 4}'], "num_layers=4 must be below the model's 4 layers")


@pytest.mark.timeout(300)
def test_cli_closing_line(capsys, tiny_model, tmp_path):
    import json

    from atoll.cli.main import main

    f = tmp_path / "p.jsonl"
    f.write_text("".join(json.dumps({"id": i, "prompt_token_ids": p}) + "\n" for i, p in enumerate(PROMPTS)))
    with pytest.raises(SystemExit) as e:
        main(["generate", "--model", str(tiny_model("llama", num_hidden_layers=4)), "--prompts", str(f),
              "--max-new-tokens", "16", "--speculative-config", json.dumps(NGRAM)])
    err = capsys.readouterr().err
    assert e.value.code == 0, err
    assert "speculative: acceptance " in err and "mean accepted length " in err, err


@pytest.fixture(scope="module")
def noisy_draft(dense, tmp_path_factory):
    """The target with noise on its LM head and last layer's MLP: a draft model that agrees
    with it often but not always (the draft cache is caught up after partial acceptance)."""
    import shutil

    from safetensors.torch import load_file, save_file

    model_dir, _ = dense
    out = tmp_path_factory.mktemp("draft")
    for f in model_dir.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    g = torch.Generator().manual_seed(7)
    for f in model_dir.glob("*.safetensors"):
        tensors = load_file(f)
        for name in tensors:
            if name == "lm_head.weight" or name.startswith("model.layers.3.mlp"):
                tensors[name] = tensors[name] + 0.08 * torch.randn(tensors[name].shape, generator=g)
        save_file(tensors, out / f.name, metadata={"format": "pt"})
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["TP1", "TP2"])
def test_greedy_with_a_draft_model(dense, noisy_draft, layout):
    model_dir, expected = dense
    spec = {"model": str(noisy_draft), "num_speculative_tokens": 3}
    outs = LLM(model_dir, layout=layout, block_size=4, speculative_config=spec).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    drafted, accepted = _spec_counts(outs)
    assert 0 < accepted < drafted


def test_draft_model_of_another_vocabulary_refused(dense, tiny_model):
    model_dir, _ = dense
    other = tiny_model("llama", vocab_size=300)
    with pytest.raises(InputError, match=r"draft model's vocabulary \(300 tokens\) is not the target's \(301\)"):
        LLM(model_dir, speculative_config={"model": str(other)})


def test_every_method_has_its_drafter():
    """The registry names a drafter for each method the config accepts, under that name."""
    from atoll.config.speculative import METHODS
    from atoll.engine.spec.registry import DRAFTERS

    assert sorted(DRAFTERS) == sorted(METHODS)
    assert all(d.method == name for name, d in DRAFTERS.items())
