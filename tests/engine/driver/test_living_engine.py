"""The living engine: ranks started once and kept between calls, requests joining a running
batch and leaving it (abort) with their blocks freed, and a dead rank failing what runs."""

import os
import signal
import threading
import time

import pytest
from reference import reference_tokens

from atoll import LLM, SamplingParams
from atoll.engine.batch.request import Request

PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3]]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except OSError:
        return False
    return True


class Collect:
    """A sink that keeps one request's events; done is set when it ends."""

    def __init__(self):
        self.tokens, self.result, self.error = [], None, None
        self.done = threading.Event()

    def __call__(self, kind, payload):
        if kind == "token":
            self.tokens.append(payload[0])
        elif kind == "finish":
            self.result = payload
            self.done.set()
        else:
            self.error = payload
            self.done.set()


def wait_for(cond, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.mark.timeout(300)
def test_a_second_generate_reuses_the_ranks(tiny_model):
    d = tiny_model("llama", num_hidden_layers=4)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    with LLM(d, layout="TP2") as llm:
        t0 = time.perf_counter()
        first = llm.generate(PROMPTS, params)
        first_s = time.perf_counter() - t0
        pids = llm._engine.job.pids
        t0 = time.perf_counter()
        again = llm.generate(PROMPTS[:1], params)
        second_s = time.perf_counter() - t0
        assert llm._engine.job.pids == pids and all(alive(p) for p in pids)  # nothing respawned
    assert [o.token_ids for o in first] == reference_tokens(d, PROMPTS, 8)
    assert again[0].token_ids == first[0].token_ids
    assert second_s < first_s, (first_s, second_s)  # no start, no load
    wait_for(lambda: not any(alive(p) for p in pids), 30)  # close() ended the ranks


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["TP1", "PP2"])
def test_requests_join_a_running_batch_and_abort_frees_blocks(tiny_model, layout):
    d = tiny_model("llama", num_hidden_layers=4)
    expected = reference_tokens(d, PROMPTS, 12)
    with LLM(d, layout=layout, max_model_len=256) as llm:
        engine = llm.start()
        long, long_id = Collect(), engine.new_id()
        engine.submit(Request(long_id, PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True)), long)
        wait_for(lambda: len(long.tokens) >= 3)
        joined = Collect()  # joins while the long one decodes
        engine.submit(Request(engine.new_id(), PROMPTS[1], SamplingParams(max_tokens=12, ignore_eos=True)), joined)
        assert joined.done.wait(60) and joined.error is None
        assert joined.result["token_ids"] == expected[1]
        assert not long.done.is_set()  # still running beside it
        engine.abort(long_id)
        assert long.done.wait(60) and long.result["finish_reason"] == "abort"
        assert long.result["token_ids"][:12] == expected[0]
        wait_for(lambda: engine.stats.get("blocks_in_use") == 0 and engine.stats.get("running") == 0)
        # and it goes on serving
        (out,) = llm.generate(PROMPTS[2:], SamplingParams(max_tokens=12, ignore_eos=True))
        assert out.token_ids == expected[2]


@pytest.mark.timeout(300)
def test_a_killed_rank_fails_what_runs_naming_it(tiny_model):
    d = tiny_model("llama", num_hidden_layers=4)
    llm = LLM(d, layout="TP2")
    engine = llm.start()
    running = Collect()
    engine.submit(Request(engine.new_id(), PROMPTS[0], SamplingParams(max_tokens=200, ignore_eos=True)), running)
    wait_for(lambda: len(running.tokens) >= 2)
    victim = engine.job.pids[1]
    os.kill(victim, signal.SIGKILL)
    assert running.done.wait(60)
    assert running.error is not None and "rank 1" in running.error and "SIGKILL" in running.error
    assert not engine.healthy and "rank 1" in engine.error
    # the next call starts new ranks
    out = llm.generate(PROMPTS[:1], SamplingParams(max_tokens=4, ignore_eos=True))
    assert out[0].token_ids == reference_tokens(d, PROMPTS[:1], 4)[0]
    assert llm._engine is not engine
    llm.close()


@pytest.mark.timeout(120)
def test_a_fault_in_the_driver_ends_every_request_with_its_line(tiny_model, monkeypatch):
    """The driver's own thread failing (a bug in it, not in a rank) ends what runs with one line
    naming it, instead of leaving the request waiting forever."""
    llm = LLM(tiny_model("llama", num_hidden_layers=4))
    engine = llm.start()
    running = Collect()
    engine.submit(Request(engine.new_id(), PROMPTS[0], SamplingParams(max_tokens=400, ignore_eos=True)), running)
    wait_for(lambda: len(running.tokens) >= 2)

    def broken(*args, **kwargs):
        raise RuntimeError("a bug\nin the driver")
    monkeypatch.setattr(engine, "_deliver", broken)
    assert running.done.wait(30)
    assert running.error == "the engine's driver failed: RuntimeError: a bug in the driver"
    assert running.result is None and not engine.healthy
    llm.close()
