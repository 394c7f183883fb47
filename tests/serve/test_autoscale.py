"""The autoscaler's decisions (serve.autoscale.decide) on synthetic load histories: which engine
it adds or turns, the local-prefill threshold first, the hysteresis that keeps a load near the
target from flapping, and --goodput's parsing."""

import pytest

from atoll.errors import InputError
from atoll.serve.autoscale import Correction, Fleet, Goodput, Policy, Sample, decide

SLO = Goodput(ttft_s=0.5, tpot_s=0.05)
POLICY = Policy(target=0.9, margin=0.05, interval_s=30, window_s=30, min_samples=3)


def history(n=6, *, every=5.0, end=100.0, ttft=0.99, tpot=0.99, waiting=0.0, kv=0.3, queue_s=None):
    """n samples ending at `end`, `every` seconds apart, all alike."""
    return [Sample(end - every * (n - 1 - i), ttft, tpot, waiting, kv, queue_s) for i in range(n)]


def test_ttft_short_on_a_disaggregated_fleet_raises_the_threshold_first_then_adds_prefill_then_turns_a_decode():
    short = history(ttft=0.6)
    d = decide(short, Fleet(prefill=1, decode=2, free=1, threshold=256), SLO, POLICY, now=100, last_at=None)
    assert (d.action, d.role, d.threshold) == ("threshold", "decode", 512)
    assert "TTFT attainment 60%" in d.reason
    at_cap = Fleet(prefill=1, decode=2, free=1, threshold=POLICY.max_threshold)
    d = decide(short, at_cap, SLO, POLICY, now=100, last_at=None)
    assert (d.action, d.role) == ("add", "prefill")
    d = decide(short, Fleet(prefill=1, decode=2, free=0, threshold=POLICY.max_threshold), SLO, POLICY, now=100,
               last_at=None)
    assert (d.action, d.role) == ("role", "prefill")
    # one decode engine only: nothing to turn, nothing free
    assert decide(short, Fleet(prefill=1, decode=1, free=0, threshold=POLICY.max_threshold), SLO, POLICY,
                  now=100, last_at=None) is None


def test_a_threshold_raise_moves_a_prompt_or_is_skipped():
    short = history(ttft=0.6)
    # the prefill engines took prompts of 64 and 4096 tokens over the window: a raise to 65 keeps the
    # 64-token ones on decode (from 16: doubling alone would move none of them)
    sent = ((95.0, 4096), (96.0, 64), (97.0, 4096))
    d = decide(short, Fleet(prefill=1, decode=2, free=1, threshold=16, remote_prompts=sent), SLO, POLICY, now=100,
               last_at=None)
    assert (d.action, d.threshold) == ("threshold", 65)
    # at least doubled
    d = decide(short, Fleet(prefill=1, decode=2, free=1, threshold=64, remote_prompts=((96.0, 70),)), SLO, POLICY,
               now=100, last_at=None)
    assert d.threshold == 128
    # only prompts at the cap went there (or none did, or only before the window): the raise is skipped
    for sent in (((96.0, 4096),), (), ((10.0, 64),)):
        d = decide(short, Fleet(prefill=1, decode=2, free=1, threshold=256, remote_prompts=sent), SLO, POLICY,
                   now=100, last_at=None)
        assert (d.action, d.role) == ("add", "prefill"), sent


def test_a_threshold_is_not_raised_when_decode_has_no_room():
    d = decide(history(ttft=0.6, kv=0.95), Fleet(prefill=1, decode=2, free=1, threshold=256), SLO, POLICY,
               now=100, last_at=None)
    assert (d.action, d.role) == ("add", "decode")  # both short: the tokens side first
    assert "KV use 95%" in d.reason


def test_tpot_short_lowers_a_raised_threshold_first_then_adds_decode_then_turns_a_prefill():
    short = history(tpot=0.5)
    d = decide(short, Fleet(prefill=2, decode=1, free=1, threshold=1024, base_threshold=256), SLO, POLICY,
               now=100, last_at=None)
    assert (d.action, d.threshold) == ("threshold", 512)
    d = decide(short, Fleet(prefill=2, decode=1, free=1, threshold=256, base_threshold=256), SLO, POLICY,
               now=100, last_at=None)
    assert (d.action, d.role) == ("add", "decode")
    d = decide(short, Fleet(prefill=2, decode=1, free=0, threshold=256), SLO, POLICY, now=100, last_at=None)
    assert (d.action, d.role) == ("role", "decode")
    assert "TPOT attainment 50%" in d.reason


def test_an_estimated_queue_wait_over_the_slo_counts_as_short_on_first_tokens():
    fleet = Fleet(prefill=1, decode=1, free=1, threshold=POLICY.max_threshold)
    d = decide(history(queue_s=0.8), fleet, SLO, POLICY, now=100, last_at=None)
    assert (d.action, d.role) == ("add", "prefill")
    assert "estimated wait 800 ms > TTFT SLO 500 ms" in d.reason  # no correction given: none named
    assert decide(history(queue_s=0.3), fleet, SLO, POLICY, now=100, last_at=None) is None


def test_replicas_are_added_when_short_and_drained_when_idle():
    d = decide(history(ttft=0.5), Fleet(replicas=1, free=1), SLO, POLICY, now=100, last_at=None)
    assert (d.action, d.role) == ("add", "replica")
    assert decide(history(ttft=0.5), Fleet(replicas=2, free=0), SLO, POLICY, now=100, last_at=None) is None
    d = decide(history(), Fleet(replicas=2, free=0), SLO, POLICY, now=100, last_at=None)
    assert (d.action, d.role) == ("drain", "replica")
    assert decide(history(), Fleet(replicas=1, free=1), SLO, POLICY, now=100, last_at=None) is None
    assert decide(history(waiting=3), Fleet(replicas=2), SLO, POLICY, now=100, last_at=None) is None


def test_a_load_hovering_near_the_target_never_flaps():
    """Attainment oscillating inside target +- margin, replayed tick by tick: no decision at all;
    and a short load decides once per interval, not at every tick."""
    fleet = Fleet(replicas=2, free=1)
    wobble = [Sample(t, 0.87 if (t // 5) % 2 else 0.93, 0.9, 1.0, 0.6) for t in range(0, 600, 5)]
    decisions = [decide(wobble[:i + 1], fleet, SLO, POLICY, now=s.at, last_at=None) for i, s in enumerate(wobble)]
    assert [d for d in decisions if d is not None] == []
    short = [Sample(t, 0.5, 0.99, 4.0, 0.6) for t in range(0, 300, 5)]
    last, made = None, []
    for i, s in enumerate(short):
        d = decide(short[:i + 1], fleet, SLO, POLICY, now=s.at, last_at=last)
        if d is not None:
            last, made = s.at, made + [s.at]
    assert len(made) == len(range(10, 300, 30)) and all(b - a >= POLICY.interval_s for a, b in zip(made, made[1:]))


def test_too_few_samples_or_an_old_history_decide_nothing():
    assert decide(history(n=2, ttft=0.1), Fleet(replicas=1, free=1), SLO, POLICY, now=100, last_at=None) is None
    assert decide(history(ttft=0.1, end=10), Fleet(replicas=1, free=1), SLO, POLICY, now=100, last_at=None) is None


def test_the_correction_factor_is_the_median_of_observed_over_predicted_over_its_window():
    c = Correction(window=5)
    assert c.estimate(2.0) == 2.0  # nothing observed: the prediction as it is
    for observed in (0.3, 0.3, 0.3, 5.0):  # one step slowed 50x by something else
        c.observe(0.1, observed)
    assert c.factor == pytest.approx(3.0) and c.estimate(2.0) == pytest.approx(6.0)
    for _ in range(5):  # the window moves on: the old ratios are gone
        c.observe(0.1, 0.05)
    assert c.factor == pytest.approx(0.5)
    c.observe(0.0, 1.0)  # no prediction: nothing to learn
    assert c.factor == pytest.approx(0.5)
    with pytest.raises(InputError, match="window=0"):
        Correction(window=0)


def test_goodput_parses_and_names_the_bad_field():
    assert Goodput.parse(["ttft:500", "tpot:50"]) == Goodput(0.5, 0.05)
    with pytest.raises(InputError, match="tpot:MS is missing"):
        Goodput.parse(["ttft:500"])
    with pytest.raises(InputError, match="'tpot:-3'.*positive"):
        Goodput.parse(["ttft:500", "tpot:-3"])
    with pytest.raises(InputError, match="'itl:5'"):
        Goodput.parse(["itl:5"])


def test_a_decision_undoing_the_last_one_waits_settle_intervals():
    """Replayed tick by tick: a replica drained when idle is not added back by a short burst
    within settle x interval_s of the drain (it flapped every interval without it), and is once that
    has passed; decisions in one direction keep the plain interval."""
    fleet = Fleet(replicas=1, free=1)
    short = history(ttft=0.5, end=140)  # samples from 115 to 140 s
    assert decide(short, fleet, SLO, POLICY, now=140, last_at=100, last="-replica") is None  # 40 s < 4 x 30 s
    d = decide(history(ttft=0.5, end=230), fleet, SLO, POLICY, now=230, last_at=100, last="-replica")
    assert (d.action, d.role) == ("add", "replica")
    d = decide(short, fleet, SLO, POLICY, now=140, last_at=100, last="+replica")  # another add: the interval only
    assert (d.action, d.role) == ("add", "replica")
    raised = Fleet(prefill=1, decode=1, free=0, threshold=512, base_threshold=256)
    assert decide(history(tpot=0.5, end=140), raised, SLO, POLICY, now=140, last_at=100, last="+threshold") is None
    with pytest.raises(InputError, match="settle >= 1"):
        Policy(settle=0.5)
