"""Lookahead drafting (engine.spec.lookahead) and speculation that switches itself off
(disable_by_batch_size, min_acceptance_rate in engine.spec.drafter): greedy tokens equal to
transformers' at TP1 and TP2 with drafts both kept and rejected, the Jacobi iterate read back
from the verify row into the window and pool, no drafts at or above disable_by_batch_size, a
sequence below the floor sitting out its pause and drafting again, bad values refused in one
line."""

import pytest
from test_speculative import GREEDY, NGRAM, PROMPTS, _in_process, _spec_counts, dense  # noqa: F401

from atoll import LLM
from atoll.config import EngineConfig
from atoll.engine.spec import drafter as drafter_module
from atoll.engine.spec.lookahead import Lookahead
from atoll.errors import InputError

LOOKAHEAD = {"method": "lookahead", "window": 4, "ngram": 3, "guess": 4}


@pytest.mark.timeout(300)
def test_greedy_tp1_in_process(dense, monkeypatch):  # noqa: F811
    model_dir, expected = dense
    seen = []  # how many Jacobi guesses each verify row handed back
    observe = Lookahead.observe
    monkeypatch.setattr(Lookahead, "observe", lambda self, at, draft, row: (
        seen.append(sum(1 for t in row[:len(draft) + 1] if t < -1)), observe(self, at, draft, row))[1])
    results, runner = _in_process(model_dir, PROMPTS, GREEDY, speculative_config=LOOKAHEAD, block_size=4)
    assert [r["token_ids"] for r in results] == expected
    drafted, accepted = _spec_counts(results)
    assert 0 < accepted < drafted  # both acceptances and rejections happened
    assert runner.stats["blocks_held"] == 0  # rejected drafts' blocks came back
    assert sum(seen) > 0  # the target's outputs past a rejection came back as guesses


@pytest.mark.timeout(300)
def test_greedy_tp2_matches_transformers(dense):  # noqa: F811
    model_dir, expected = dense
    outs = LLM(model_dir, layout="TP2", speculative_config=LOOKAHEAD).generate(PROMPTS, GREEDY)
    assert [o.token_ids for o in outs] == expected
    drafted, accepted = _spec_counts(outs)
    assert 0 < accepted < drafted


def test_the_verify_row_fills_window_and_pool():
    """Step 1 drafted [10, 11, 12] at positions 5..7; the target kept 10, then gave 20 where 11
    stood (taken) and guesses 21, 22 after. Step 2 drafted [21, 22, 23] at 7..9; it kept 21 and
    guessed 30, 31, 32 for 8..10. The window is the latest guesses by position; the pool takes
    the diagonal of the last two iterations: step 1's input at p-2, step 2's at p-1, the guess at p."""
    la = Lookahead(ngram=3, guess=2)
    la.observe(5, [10, 11, 12], [10, 20, -2 - 21, -2 - 22])
    assert la.window == {7: 21, 8: 22}
    assert la.pool == {}  # one iteration: no diagonal of 3 yet
    la.observe(7, [21, 22, 23], [21, -2 - 30, -2 - 31, -2 - 32])
    assert la.window == {8: 30, 9: 31, 10: 32}
    # 30 at 8 after 21 at 7 (step 2) after 11 at 6 (step 1); 31 at 9 after 22 after 12; 32 at 10
    # has no step-1 input at 8
    assert la.pool == {11: [(21, 30)], 12: [(22, 31)]}
    la.observe(8, [30, 31, 32], [30, -1, -1, -1])  # a sampled row: no guesses come back
    assert la.window == {} and la.pool == {11: [(21, 30)], 12: [(22, 31)]}


def test_draft_prefers_the_pool_then_the_window():
    la = Lookahead(ngram=3, guess=2)
    tokens = [1, 2, 3, 1, 2, 4, 5, 2]
    # the sequence's own 3-grams: 2 was followed by (3, 1) and then (4, 5); the latest is kept last
    assert la.draft(tokens, 2) == [4, 5]
    la.window = {10: 77, 11: 78}
    assert la.draft(tokens, 4) == [4, 5, 77, 78]  # the window's guesses for positions 10, 11
    for gram in [(2, 6, 6), (2, 7, 7), (2, 8, 8)]:
        la.add(gram)
    assert la.pool[2] == [(7, 7), (8, 8)]  # at most guess=2 per first token, the oldest dropped


def _sits_out_log(monkeypatch):
    log = []
    sits_out = drafter_module.Drafter._sits_out
    monkeypatch.setattr(drafter_module.Drafter, "_sits_out",
                        lambda self, index: log.append((index, sits_out(self, index))) or log[-1][1])
    return log


@pytest.mark.timeout(300)
@pytest.mark.parametrize("method", [NGRAM, LOOKAHEAD], ids=["ngram", "lookahead"])
def test_below_the_floor_a_sequence_pauses_then_drafts_again(dense, monkeypatch, method):  # noqa: F811
    model_dir, expected = dense
    log = _sits_out_log(monkeypatch)
    cfg = dict(method, min_acceptance_rate=0.9, acceptance_window=2, pause_steps=3)
    results, _ = _in_process(model_dir, PROMPTS, GREEDY, speculative_config=cfg, block_size=4)
    assert [r["token_ids"] for r in results] == expected
    log = list(log)  # this run's steps only
    full, _ = _in_process(model_dir, PROMPTS, GREEDY, speculative_config=method, block_size=4)
    assert sum(r["metrics"]["spec_steps"] for r in results) < sum(r["metrics"]["spec_steps"] for r in full)
    resumed = 0
    for index in range(len(PROMPTS)):
        mine = [out for i, out in log if i == index]
        runs, at = [], 0
        while at < len(mine):  # lengths of each run of steps sat out
            if mine[at]:
                end = at
                while end < len(mine) and mine[end]:
                    end += 1
                runs.append((end - at, end < len(mine)))
                at = end
            else:
                at += 1
        assert all(n == 3 for n, done in runs if done)  # a pause lasts pause_steps steps
        resumed += sum(done for _, done in runs)
    assert resumed > 0  # some sequence paused and then drafted again


@pytest.mark.timeout(300)
def test_disable_by_batch_size_lookahead(dense):  # noqa: F811
    model_dir, expected = dense
    results, _ = _in_process(model_dir, PROMPTS, GREEDY, speculative_config=dict(LOOKAHEAD, disable_by_batch_size=4))
    assert [r["token_ids"] for r in results] == expected
    assert _spec_counts(results) == (0, 0)
    results, _ = _in_process(model_dir, PROMPTS, GREEDY, speculative_config=dict(LOOKAHEAD, disable_by_batch_size=5))
    assert _spec_counts(results)[0] > 0  # below the size it drafts


@pytest.mark.parametrize("bad,says", [
    ({"method": "lookahead", "ngram": 1}, "ngram=1"),
    ({"method": "lookahead", "window": 2, "ngram": 4}, "window=2"),
    ({"method": "lookahead", "guess": 0}, "guess=0"),
    ({"method": "lookahead", "window": "5"}, "window='5'"),
    ({"method": "ngram", "window": 5}, "'window' goes with method lookahead"),
    ({"method": "ngram", "min_acceptance_rate": 0}, "min_acceptance_rate=0"),
    ({"method": "ngram", "min_acceptance_rate": 1.5}, "min_acceptance_rate=1.5"),
    ({"method": "ngram", "min_acceptance_rate": True}, "min_acceptance_rate=True"),
    ({"method": "ngram", "pause_steps": 0}, "pause_steps=0"),
    ({"method": "ngram", "acceptance_window": -1}, "acceptance_window=-1"),
])
def test_bad_config_one_line(bad, says):
    with pytest.raises(InputError, match=says) as e:
        EngineConfig(speculative_config=bad)
    assert "\n" not in str(e.value)


def test_lookahead_defaults_and_k():
    cfg = EngineConfig(speculative_config={"method": "lookahead"}).speculative_config
    assert (cfg.window, cfg.ngram, cfg.guess, cfg.k) == (5, 4, 5, 5)


def test_lookahead_on_pipeline_stages_refused(dense):  # noqa: F811
    """Like the drafters with a model, it keeps state per sequence and runs on one stage."""
    with pytest.raises(InputError, match="lookahead runs on one pipeline stage") as e:
        LLM(dense[0], layout="PP2", speculative_config=LOOKAHEAD)
    assert "\n" not in str(e.value)
