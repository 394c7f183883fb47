"""Fault injection (config/faults.py, engine/rank/faults.py) on a real TP2 engine: a delayed rank
slows every step by its delay and changes no token; a killed rank ends the run with an error
naming it. (A dropped rank's peers wait for the launcher's collective timeout, as the ranks
read it from ATOLL_COLLECTIVE_TIMEOUT_S; that path is not tested here.) And the spec's one-line
errors."""

import dataclasses
import time

import pytest
from reference import reference_tokens

from atoll import LLM, SamplingParams
from atoll.config import EngineConfig
from atoll.config.faults import Fault, FaultInjection
from atoll.engine.driver.online import EngineDead
from atoll.errors import InputError

PROMPTS = [[5, 7, 9, 11, 13], [100, 3]]
NEW = 12


def test_the_spec_parses_and_round_trips():
    f = EngineConfig(fault_injection="kill:rank=1:step=40, delay:rank=0:ms=2.5:step=3").fault_injection
    assert f.faults == (Fault("kill", 1, 40), Fault("delay", 0, 3, 2.5))
    assert FaultInjection.parse(str(f)) == f and f.on_rank(0) == [Fault("delay", 0, 3, 2.5)]
    assert EngineConfig().fault_injection is None and EngineConfig(fault_injection="").fault_injection is None
    # as a replica's engine gets it (dataclasses.asdict), with and without a replica named
    g = FaultInjection.parse("delay:rank=0:ms=4,kill:rank=0:step=9:replica=1")
    assert FaultInjection.parse(dataclasses.asdict(g)) == g


@pytest.mark.parametrize("spec, message", [
    ("boom:rank=1", "the kind 'boom' is not one of kill, delay, drop"),
    ("kill:step=3", "rank= is missing"),
    ("kill:rank=-1", "rank='-1' must be a whole number of at least 0"),
    ("kill:rank=1:step=x", "step='x' must be a whole number of at least 0"),
    ("delay:rank=1", "ms= (the delay in milliseconds, above 0) is missing"),
    ("delay:rank=1:ms=0", "ms='0' must be a number of milliseconds above 0"),
    ("kill:rank=1:ms=3", "'ms=3' is not one of kill's fields (rank=, step=, replica=)"),
])
def test_bad_specs_are_one_line_naming_the_field(spec, message):
    with pytest.raises(InputError) as e:
        EngineConfig(fault_injection=spec)
    assert message in str(e.value) and "\n" not in str(e.value)


def test_a_rank_the_engine_lacks_is_refused_before_any_rank_starts(tiny_model):
    with pytest.raises(InputError, match=r"rank=2 is not a rank of this engine \(it has 2: 0..1\)"):
        LLM(tiny_model("llama"), layout="TP2", fault_injection="kill:rank=2")


@pytest.fixture(scope="module")
def model_and_reference(tiny_model):
    d = tiny_model("llama")
    return d, reference_tokens(d, PROMPTS, NEW)


def _timed(d, **options):
    with LLM(d, layout="TP2", **options) as llm:
        llm.generate([[1, 2]], SamplingParams(max_tokens=2, ignore_eos=True))  # started and warm
        started = time.monotonic()
        out = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
        return [o.token_ids for o in out], time.monotonic() - started


@pytest.mark.timeout(300)
def test_a_delayed_rank_slows_each_step_and_changes_no_token(model_and_reference):
    d, expected = model_and_reference
    ms = 150
    tokens, seconds = _timed(d, fault_injection=f"delay:rank=1:ms={ms}")
    assert tokens == expected
    # NEW steps (one prefill, NEW - 1 decodes) of this run, each at least the delay
    assert seconds >= NEW * ms / 1000, seconds
    plain_tokens, plain = _timed(d)
    assert plain_tokens == expected
    print(f"\n{NEW} tokens: {seconds:.2f} s with rank 1 delayed {ms} ms a step, {plain:.2f} s without")
    assert seconds - plain >= 0.8 * NEW * ms / 1000, (seconds, plain)


@pytest.mark.timeout(300)
def test_a_killed_rank_ends_the_run_naming_it(model_and_reference):
    d, _ = model_and_reference
    with LLM(d, layout="TP2", fault_injection="kill:rank=1:step=4") as llm:
        with pytest.raises(EngineDead, match="rank 1 .*SIGKILL"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True), timeout_s=120)


@pytest.mark.timeout(300)
def test_a_rank_slower_than_the_stall_timeout_fails_the_engine(model_and_reference):
    """--stall-timeout-s: rank 1 sleeping 4 s a step from its 3rd is marked failed within about
    the timeout (a server then restarts it); without it the same run just finishes slowly."""
    d, _ = model_and_reference
    with LLM(d, layout="TP2", fault_injection="delay:rank=1:ms=4000:step=3", stall_timeout_s=1.0) as llm:
        started = time.monotonic()
        with pytest.raises(EngineDead, match=r"the ranks sent no step for 1 s while 2 requests ran"):
            llm.generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True), timeout_s=120)
        waited = time.monotonic() - started
    print(f"\nrank 1 slowed to 4 s a step: marked failed {waited:.1f} s after the run began")
    assert waited < 4 * (NEW - 3), waited  # long before the slowed run could have ended
