"""atoll bench serve: the metric math (vLLM's definitions) with exact values, the load's
arrivals and requests, the streaming client against a fake OpenAI server, and one smoke run
of the command against `atoll serve` on a tiny model."""

import asyncio
import json
import math
import os
import socket
import threading
import time
from types import SimpleNamespace

import pytest

from atoll.bench.serve_compare import plan_workload
from atoll.bench.serve_load import payload, run_load
from atoll.planner.sim.load import BenchRequest, arrival_times, jsonl_requests, random_requests
from atoll.planner.sim.report import (RequestResult, goodput, meets, parse_goodput, parse_percentiles, percentile,
                                      report, summarize)
from atoll.bench.serve_server import engine_argv
from atoll.errors import ConfigError, InputError


def ok(ttft, latency, n, itl=(), prompt=10):
    return RequestResult(success=True, prompt_tokens=prompt, output_tokens=n, ttft=ttft, latency=latency,
                         itl=list(itl), usage=True)


# --- the metric math ---


def test_percentile_interpolates_like_numpy():
    assert percentile([4, 1, 3, 2], 50) == 2.5
    assert percentile(range(1, 11), 90) == pytest.approx(9.1, abs=1e-12)  # rank 8.1: 9 + 0.1 x 1
    assert percentile([0, 100], 99) == 99
    assert percentile([0, 100], 100) == 100 and percentile([0, 100], 0) == 0
    assert percentile([5], 99) == 5
    assert percentile([], 50) is None
    with pytest.raises(ValueError):
        percentile([1], 101)


def test_summarize_in_milliseconds():
    s = summarize([0.5, 1.0, 1.5, 2.0], (50, 90, 99))
    assert s == {"mean": 1250.0, "p50": 1250.0, "p90": pytest.approx(1850.0, abs=1e-9),
                 "p99": pytest.approx(1985.0, abs=1e-9)}
    assert summarize([], (50, 99.9)) == {"mean": None, "p50": None, "p99_9": None}


def test_tpot_is_decode_time_over_tokens_after_the_first():
    assert ok(0.25, 1.25, 5).tpot == 0.25  # (1.25 - 0.25) / 4
    assert ok(0.25, 0.25, 1).tpot == 0.0  # one token: no TPOT (vLLM feeds 0 to goodput)
    assert RequestResult().tpot == 0.0


def test_parse_goodput_and_percentiles():
    assert parse_goodput(["ttft:200", "TPOT:50.5", "e2el:1000"]) == {"ttft": 200.0, "tpot": 50.5, "e2el": 1000.0}
    assert parse_goodput(None) == {}
    for bad in (["itl:5"], ["ttft"], ["ttft:fast"], ["ttft:-1"], ["ttft:inf"], ["ttft:1", "ttft:2"]):
        with pytest.raises(ConfigError):
            parse_goodput(bad)
    assert parse_percentiles("50,90,99") == (50.0, 90.0, 99.0)
    for bad in ("", "0,50", "100", "x"):
        with pytest.raises(ConfigError):
            parse_percentiles(bad)


def test_goodput_counts_requests_meeting_every_slo():
    results = [ok(0.125, 0.625, 5),  # ttft 125 ms (= the SLO: met), tpot 125 ms (met)
               ok(0.0625, 0.3125, 5),  # ttft 62.5, tpot 62.5: both met
               ok(0.375, 0.5, 2),  # ttft 375: missed; tpot 125
               ok(0.03125, 0.03125, 1),  # one token: tpot 0, met
               RequestResult(error="HTTP 500")]  # failed: meets nothing
    slos = {"ttft": 125.0, "tpot": 125.0}
    assert [meets(r, slos) for r in results] == [True, True, False, True, False]
    g = goodput(results, slos, duration_s=2.0)
    assert g["good_requests"] == 3
    assert g["request_goodput"] == 1.5  # 3 requests / 2 s
    assert g["output_token_goodput"] == 5.5  # (5 + 5 + 1) tokens / 2 s
    assert g["attainment"] == 0.6  # 3 of the 5 sent
    assert g["attainment_by_slo"] == {"ttft": 0.6, "tpot": 0.8}
    assert goodput(results, {"tpot": 124.0}, 2.0)["good_requests"] == 2  # 125 ms misses 124


def test_report_figures():
    results = [ok(0.1, 1.1, 11, itl=[0.1] * 10, prompt=8), ok(0.2, 0.2, 1, prompt=8),
               ok(0.3, 0.7, 5, itl=[0.1, 0.1, 0.1, 0.1], prompt=8), RequestResult(prompt_tokens=8, error="boom")]
    r = report(results, 2.0, slos={"e2el": 1000.0}, percentiles=(50, 99))
    assert (r["requests"], r["completed"], r["failed"]) == (4, 3, 1)
    assert (r["total_input_tokens"], r["total_output_tokens"]) == (24, 17)
    assert (r["request_throughput"], r["output_throughput"], r["total_token_throughput"]) == (1.5, 8.5, 20.5)
    assert r["ttft_ms"]["mean"] == pytest.approx(200.0)
    assert r["tpot_ms"]["mean"] == pytest.approx(100.0)  # both multi-token requests: 100 ms; the 1-token one left out
    assert r["itl_ms"]["p50"] == pytest.approx(100.0)  # 14 gaps pooled
    assert r["e2el_ms"]["p50"] == pytest.approx(700.0)
    assert r["goodput"]["good_requests"] == 2 and r["goodput"]["attainment"] == 0.5
    assert r["errors"] == ["boom"] and r["token_counts_from_usage"] is True


# --- the load ---


def test_arrivals_all_at_once_at_rate_inf():
    assert arrival_times(4, rate=math.inf) == [0.0] * 4


def test_poisson_and_gamma_arrivals():
    t = arrival_times(20000, rate=4.0, seed=1)
    gaps = [b - a for a, b in zip(t, t[1:])]
    assert t[0] == 0.0 and min(gaps) >= 0
    assert sum(gaps) / len(gaps) == pytest.approx(0.25, rel=0.03)  # mean 1 / rate
    cv2 = lambda g: (sum(x * x for x in g) / len(g) - (sum(g) / len(g)) ** 2) / (sum(g) / len(g)) ** 2  # noqa: E731
    assert cv2(gaps) == pytest.approx(1.0, rel=0.06)  # exponential: CV^2 = 1
    bursty = arrival_times(20000, rate=4.0, burstiness=0.25, seed=1)
    bgaps = [b - a for a, b in zip(bursty, bursty[1:])]
    assert sum(bgaps) / len(bgaps) == pytest.approx(0.25, rel=0.06)  # same mean rate
    assert cv2(bgaps) == pytest.approx(4.0, rel=0.1)  # gamma shape k: CV^2 = 1 / k
    assert arrival_times(5, rate=2.0, seed=3) == arrival_times(5, rate=2.0, seed=3)
    for bad in (dict(rate=0.0), dict(rate=1.0, burstiness=0.0)):
        with pytest.raises(ConfigError):
            arrival_times(3, **bad)


def test_random_requests():
    rs = random_requests(5, input_len=7, output_len=3, vocab_size=50, seed=2)
    assert [(len(r.prompt), r.output_len) for r in rs] == [(7, 3)] * 5
    assert all(0 <= t < 50 for r in rs for t in r.prompt)
    assert rs == random_requests(5, input_len=7, output_len=3, vocab_size=50, seed=2)
    varied = random_requests(200, input_len=100, output_len=10, vocab_size=50, range_ratio=0.5)
    assert {len(r.prompt) for r in varied} <= set(range(50, 151)) and len({len(r.prompt) for r in varied}) > 10
    assert {r.output_len for r in varied} <= set(range(5, 16))


def test_jsonl_requests(tmp_path):
    f = tmp_path / "p.jsonl"
    f.write_text('{"prompt": "hello"}\n\n{"prompt": [1, 2, 3], "output_len": 4}\n')
    rs = jsonl_requests(str(f), 3, output_len=9)
    assert rs == [BenchRequest("hello", 9), BenchRequest([1, 2, 3], 4), BenchRequest("hello", 9)]
    assert rs[1].prompt_len == 3 and rs[0].prompt_len is None
    for text in ('{"prompt": ""}', '{"prompt": [1, -1]}', "not json", '{"prompt": "a", "output_len": 0}'):
        f.write_text(text)
        with pytest.raises(InputError):
            jsonl_requests(str(f), 1, output_len=1)


def test_payload_asks_for_exact_lengths():
    body = payload("m", BenchRequest([5, 6], 12))
    assert body["prompt"] == [5, 6] and body["max_tokens"] == 12 and body["stream"] is True
    assert body["stream_options"] == {"include_usage": True}
    assert body["ignore_eos"] is True and body["min_tokens"] == 12 and body["return_token_ids"] is True
    assert "ignore_eos" not in payload("m", BenchRequest("x", 3), ignore_eos=False)


def test_engine_argv_forwards_only_what_was_set():
    from atoll.cli.main import build_parser

    args = build_parser().parse_args(["bench", "serve", "--layout", "TP1", "--max-num-seqs", "8",
                                      "--no-enable-prefix-caching", "--request-rate", "2"])
    assert engine_argv(args) == ["--layout", "TP1", "--max-num-seqs", "8", "--no-enable-prefix-caching"]
    argv = engine_argv(args, max_num_batched_tokens=4200)
    assert argv[argv.index("--max-num-batched-tokens") + 1] == "4200" and len(argv) == 7


def test_plan_workload():
    w, how = plan_workload(isl=128, osl=32, requests=40, rate=2.0, max_concurrency=None, max_num_seqs=32, dtype="fp32")
    assert w == dict(isl=128, osl=32, dtype="fp32", kv_dtype="fp32", concurrency=32, request_rate=2.0)
    assert "open loop" in how
    w, how = plan_workload(isl=128, osl=32, requests=40, rate=math.inf, max_concurrency=4, max_num_seqs=32,
                           dtype="fp32")
    assert w["concurrency"] == 4 and "request_rate" not in w
    w, how = plan_workload(isl=128, osl=32, requests=20, rate=math.inf, max_concurrency=None, max_num_seqs=32,
                           dtype="fp32")
    assert w["concurrency"] == 20 and "burst" in how


# --- the streaming client against a fake OpenAI-compatible server ---


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def fake_server():
    """A FastAPI app streaming max_tokens chunks 20 ms apart (usage last, as OpenAI's
    include_usage does), refusing prompts that contain the token id 0 with a 400."""
    import uvicorn
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse, StreamingResponse

    app = FastAPI()
    seen = []

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": "fake-model", "object": "model"}]}

    @app.post("/v1/completions")
    async def completions(request: Request):
        body = await request.json()
        seen.append(body)
        if 0 in body["prompt"]:
            return JSONResponse({"error": {"message": "token 0 is refused"}}, status_code=400)

        async def events():
            for i in range(body["max_tokens"]):
                await asyncio.sleep(0.02)
                yield "data: " + json.dumps({"choices": [{"index": 0, "text": f"t{i}"}]}) + "\n\n"
            usage = {"prompt_tokens": len(body["prompt"]), "completion_tokens": body["max_tokens"]}
            yield "data: " + json.dumps({"choices": [], "usage": usage}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert server.started
    yield SimpleNamespace(url=f"http://127.0.0.1:{port}", seen=seen)
    server.should_exit = True
    thread.join(10)


def test_client_times_a_stream(fake_server):
    from atoll.bench.serve_load import served_model

    assert served_model(fake_server.url, "x") == "fake-model"
    reqs = [BenchRequest([1, 2, 3], 5), BenchRequest([0, 1], 3), BenchRequest([4], 1)]
    results, duration = asyncio.run(run_load(fake_server.url, "fake-model", reqs, rate=math.inf, timeout_s=30))
    a, refused, one = results
    assert a.success and a.usage and (a.prompt_tokens, a.output_tokens) == (3, 5)
    assert len(a.itl) == 4 and all(0.01 < g < 1.0 for g in a.itl)
    assert a.ttft >= 0.015 and a.latency == pytest.approx(a.ttft + sum(a.itl), abs=1e-9)
    assert not refused.success and refused.error.startswith("HTTP 400") and "token 0 is refused" in refused.error
    assert one.success and one.itl == [] and one.tpot == 0.0
    assert duration >= a.latency
    assert fake_server.seen[-1]["model"] == "fake-model"


def test_client_closed_loop_caps_requests_in_flight(fake_server):
    reqs = [BenchRequest([1], 5) for _ in range(4)]
    results, duration = asyncio.run(run_load(fake_server.url, "m", reqs, max_concurrency=1, timeout_s=30))
    starts = sorted(r.start for r in results)
    ends = sorted(r.start + r.latency for r in results)
    assert all(s >= e - 1e-3 for s, e in zip(starts[1:], ends))  # one at a time: each starts after the last ended
    assert duration >= 4 * 5 * 0.02


def test_client_bounds_the_run(fake_server):
    results, _ = asyncio.run(run_load(fake_server.url, "m", [BenchRequest([1], 200)], timeout_s=0.3))
    assert not results[0].success and "timed out" in results[0].error


# --- the command, end to end, against `atoll serve` on a tiny model ---


@pytest.mark.slow
def test_bench_serve_smoke(tiny_model, tmp_path):
    """`atoll bench serve --json` starts `atoll serve`, loads it, compares with the planner and
    with LLM.generate, and reports consistent figures; the server is gone afterwards."""
    import os
    import signal
    import subprocess
    import sys

    model = tiny_model("llama")
    cmd = [sys.executable, "-m", "atoll", "bench", "serve", "--json", "--model", str(model), "--num-prompts", "6",
           "--input-len", "8", "--output-len", "5", "--request-rate", "40", "--goodput", "ttft:60000", "tpot:60000",
           "--compare-plan", "--compare-offline", "--rounds", "2", "--max-num-seqs", "4", "--max-model-len", "64",
           "--timeout", "60", "--server-timeout", "60"]
    env = {**os.environ, "ATOLL_ENFORCE_EAGER": "1", "ATOLL_CACHE": str(tmp_path / "cache")}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)  # the bench ends the server it started, then exits
        try:
            proc.communicate(timeout=60)
        finally:
            proc.kill()
        pytest.fail("atoll bench serve did not finish in 150 s")
    assert proc.returncode == 0, err[-2000:]
    r = json.loads(out)
    s = r["serve"]
    assert (s["requests"], s["completed"], s["failed"]) == (6, 6, 0)
    assert s["total_input_tokens"] == 6 * 8 and s["total_output_tokens"] == 6 * 5  # exact lengths: ignore_eos
    assert s["token_counts_from_usage"] is True
    for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms"):
        x = s[m]
        assert 0 < x["p50"] <= x["p90"] <= x["p99"], (m, x)
    assert s["ttft_ms"]["p99"] <= s["e2el_ms"]["p99"]
    g = s["goodput"]
    assert 0 <= g["attainment"] <= 1 and g["good_requests"] <= s["completed"]
    assert g["request_goodput"] <= s["request_throughput"] and g["output_token_goodput"] <= s["output_throughput"]
    assert s["output_throughput"] == pytest.approx(30 / s["duration_s"])
    assert r["server_args"] == ["--max-num-seqs", "4", "--max-model-len", "64"]
    assert r["offline"]["output_tokens"] == 30 and r["serve_over_offline"] > 0
    assert [x["order"] for x in r["rounds"]] == [["offline", "serve"], ["serve", "offline"]]
    assert all(x["serve_over_offline"] > 0 for x in r["rounds"])
    assert all(set(x["serve_cpu_s"]) == {"client", "server", "ranks"} for x in r["rounds"])
    assert all(x["offline"]["cpu_s"]["ranks"] > 0 for x in r["rounds"])
    p = r["plan"]
    assert p["predicted"]["layout"] == "TP1" and p["predicted"]["workload"]["request_rate"] == 40
    assert set(p["measured_over_predicted"]) == {"ttft", "tpot", "output_throughput"}
    sim = p["simulated"]["serve"]  # the same six requests and arrivals through the simulator
    assert (sim["completed"], sim["total_output_tokens"]) == (6, 30)
    assert p["simulated"]["deployment"] == "1 x TP1"
    assert {"ttft_p50", "tpot_p50", "tpot_p90", "goodput"} <= set(p["measured_over_simulated"])
    assert all(v is None or v > 0 for v in p["measured_over_simulated"].values())
    assert r["load_avg_1m"] and r["cores"] >= 1


def test_mixed_requests_have_the_long_share():
    from atoll.planner.sim.load import mixed_requests

    reqs = mixed_requests(400, input_len=8, long_len=64, long_share=0.1, output_len=4, vocab_size=50, seed=3)
    lens = [r.prompt_len for r in reqs]
    assert set(lens) == {8, 64} and 20 <= lens.count(64) <= 60  # 40 expected; binomial sd 6
    assert mixed_requests(5, input_len=8, long_len=64, long_share=0.1, output_len=4, vocab_size=50,
                          seed=3)[0].prompt == reqs[0].prompt  # seeded


@pytest.mark.slow
def test_bench_serve_disagg_scenario(tiny_model, tmp_path):
    """--scenario disagg runs the same requests on a colocated and a disaggregated server: both
    complete every request, and the disaggregated side's paths add up to them."""
    import subprocess
    import sys

    model = tiny_model("llama")
    cmd = [sys.executable, "-m", "atoll", "bench", "serve", "--json", "--model", str(model), "--scenario", "disagg",
           "-pp", "2", "--prefill", "TP1", "--decode", "TP1", "--disagg-min-prompt-tokens", "16",
           "--num-prompts", "10", "--input-len", "8", "--long-len", "40", "--long-share", "0.3", "--output-len", "4",
           "--request-rate", "50", "--goodput", "ttft:60000", "--max-model-len", "64", "--timeout", "60",
           "--server-timeout", "60"]
    env = {**os.environ, "ATOLL_ENFORCE_EAGER": "1", "ATOLL_CACHE": str(tmp_path / "cache")}
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    r = json.loads(proc.stdout)
    c, d = r["colocated"], r["disaggregated"]
    assert (c["completed"], d["completed"]) == (10, 10) and c["failed"] == d["failed"] == 0
    assert d["paths"]["prefill"] == r["long_prompts"] and d["paths"]["decode"] == 10 - r["long_prompts"]
    assert "--prefill" not in c["server_args"] and "--pipeline-parallel-size" not in d["server_args"]
    assert c["goodput"]["attainment"] == d["goodput"]["attainment"] == 1.0
