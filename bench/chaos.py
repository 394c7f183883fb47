"""`atoll bench serve --chaos SPEC`: the load twice on one server, first without faults, then
with SPEC's faults struck on its ranks (bench/chaos_spec.py) while it runs. The rank pids come
from the server's admin API (the server started here runs with --enable-admin-api; a --url
server must too, on this machine). Reported:

- requests lost (must be 0: neither all their tokens nor an error naming a cause) and failed
  (an error the server sent, with its cause);
- the texts checked: each request's token ids against the no-fault run's (greedy);
- per fault, TTFT and TPOT p50/p99 of the requests sent before, during and after it;
- the time to recover capacity: from the fault to every engine serving again (a killed rank's
  engine restarted, a stopped one continued or restarted).
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import replace

from atoll.bench.chaos_spec import PERIOD_S, outside_recovery, parse_chaos, phases
from atoll.bench.serve_load import payload, send, served_model, warm_up
from atoll.bench.serve_server import Server, engine_argv
from atoll.errors import ConfigError, LaunchError
from atoll.planner.sim.load import arrival_times, random_requests
from atoll.planner.sim.report import RequestResult

RECOVER_S = 120.0  # how long a fault's recovery is waited for before the next fault


def _engines(url: str) -> list[dict]:
    import httpx  # lazy: httpx is the optional atoll[serve]

    r = httpx.get(url.rstrip("/") + "/admin/engines", timeout=10)
    if r.status_code != 200:
        raise LaunchError(f"--chaos needs the server's admin API (--enable-admin-api): GET /admin/engines "
                          f"answered {r.status_code}")
    return r.json()["data"]


async def _load(url: str, model: str, requests, args) -> tuple[list[RequestResult], list[list[int]], float]:
    """Every request at its arrival time: (results, each one's token ids, seconds)."""
    import httpx  # lazy: as above

    endpoint = url.rstrip("/") + "/v1/completions"
    times = arrival_times(len(requests), rate=args.request_rate, burstiness=args.burstiness, seed=args.seed)
    ids: list[list[int]] = [[] for _ in requests]
    async with httpx.AsyncClient(timeout=httpx.Timeout(args.timeout, connect=10.0),
                                 limits=httpx.Limits(max_connections=len(requests))) as client:
        t0 = time.perf_counter()

        async def one(i: int, at: float) -> RequestResult:
            await asyncio.sleep(max(0.0, t0 + at - time.perf_counter()))
            start = time.perf_counter()
            try:
                r = await asyncio.wait_for(send(client, endpoint, payload(model, requests[i]), token_ids=ids[i],
                                                prompt_len=requests[i].prompt_len), args.timeout)
            except asyncio.TimeoutError:
                r = RequestResult(error=f"timed out after {args.timeout:g} s (lost)")
            r.start = start - t0
            return r

        results = await asyncio.gather(*(one(i, at) for i, at in enumerate(times)))
        return list(results), ids, time.perf_counter() - t0


async def _strike(url: str, faults, t0: float, log: list) -> list[float | None]:
    """Each fault at its time (or once the last one recovered, if later); the seconds from t0
    at which every engine served again after each (None: not within RECOVER_S)."""
    recovered = []
    for i, f in enumerate(faults):
        await asyncio.sleep(max(0.0, t0 + f.at_s - time.perf_counter()))
        pids = await _ranks_of(url, f.engine, log, t0)
        if pids is None:  # down for good (a crash loop): nothing to strike
            recovered.append(None)
            continue
        if f.rank >= len(pids):
            raise ConfigError(f"--chaos: engine {f.engine} has ranks 0..{len(pids) - 1}, not rank {f.rank}")
        pid = pids[f.rank]
        struck = time.perf_counter() - t0
        faults[i] = f = replace(f, at_s=round(struck, 2))
        log.append(f"{struck:7.2f} s  {f.label()} (pid {pid})")
        if f.kind == "kill":
            os.kill(pid, signal.SIGKILL)
        else:
            pause = f.for_s if f.kind == "stop" else f.ms / 1000
            end = time.perf_counter() + f.for_s
            while time.perf_counter() < end:
                _signal(pid, signal.SIGSTOP)
                await asyncio.sleep(min(pause, max(0.0, end - time.perf_counter())))
                _signal(pid, signal.SIGCONT)
                if f.kind == "slow":
                    await asyncio.sleep(PERIOD_S - pause)
        recovered.append(await _recovered(url, pid if f.kind == "kill" else None, t0, log))
    return recovered


async def _ranks_of(url: str, engine: int, log: list, t0: float) -> list[int] | None:
    """The engine's rank pids; while it has none (starting again), waited for up to RECOVER_S;
    None, with a line in the log, when it stays without (left down after a crash loop)."""
    deadline = time.perf_counter() + RECOVER_S
    while True:
        e = (await asyncio.to_thread(_engines, url))[engine]
        if e["pids"] and e["state"] == "serving":
            return e["pids"]
        if time.perf_counter() >= deadline:
            log.append(f"{time.perf_counter() - t0:7.2f} s  engine {engine} skipped: {e['state']} with no rank to "
                       f"strike after {RECOVER_S:g} s (left down: more --max-restarts?)")
            return None
        await asyncio.sleep(0.2)


def _signal(pid: int, sig) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:  # restarted meanwhile: its engine drained and killed it
        pass


async def _recovered(url: str, killed: int | None, t0: float, log: list) -> float | None:
    deadline = time.perf_counter() + RECOVER_S
    await asyncio.sleep(0.2)
    while time.perf_counter() < deadline:
        engines = await asyncio.to_thread(_engines, url)
        if all(e["state"] == "serving" and e["health"] == "ok" and killed not in e["pids"] for e in engines):
            at = time.perf_counter() - t0
            log.append(f"{at:7.2f} s  every engine serving again")
            return at
        await asyncio.sleep(0.1)
    log.append(f"capacity not back within {RECOVER_S:g} s")
    return None


async def _faulted(url: str, model: str, requests, faults, args):
    t0 = time.perf_counter()
    log: list[str] = []
    striking = asyncio.create_task(_strike(url, faults, t0, log))
    results, ids, duration = await _load(url, model, requests, args)
    recovered = await striking
    late = [f for f in faults if f.at_s >= duration]
    if late:
        log.append(f"{len(late)} fault(s) struck after the load ended ({duration:.1f} s): nothing was measured "
                   "around them (more --num-prompts, or earlier times)")
    return results, ids, duration, recovered, log


def run_chaos(args, bench, model_dir: str, vocab_size: int) -> dict:
    osl = args.output_len or 32
    requests = random_requests(args.num_prompts, input_len=args.input_len, output_len=osl, vocab_size=vocab_size,
                               seed=args.seed, range_ratio=args.range_ratio)
    warm = random_requests(2, input_len=args.input_len, output_len=osl, vocab_size=vocab_size, seed=args.seed + 7)
    argv = engine_argv(args) + ["--enable-admin-api"]
    if getattr(args, "max_restarts", None) is not None:
        argv += ["--max-restarts", str(args.max_restarts)]
    server = Server(model_dir, argv, ready_timeout_s=args.server_timeout) if not args.url else None
    url = server.start() if server else args.url
    try:
        faults = parse_chaos(args.chaos, len(_engines(url)))
        model = served_model(url, model_dir)
        warm_up(url, model, warm, args)
        clean, clean_ids, clean_s = asyncio.run(_load(url, model, requests, args))
        bench.note()
        results, ids, duration, recovered, log = asyncio.run(_faulted(url, model, requests, faults, args))
        bench.note()
    finally:
        if server:
            server.stop()
    failed = [r for r in results if not r.success and r.error.startswith(("HTTP", "stream error"))]
    lost = [r for r in results if (not r.success and not r.error.startswith(("HTTP", "stream error")))
            or (r.success and r.output_tokens < osl)]
    checked = [i for i, r in enumerate(results) if r.success and clean[i].success]
    differ = [i for i in checked if ids[i] != clean_ids[i]]
    return {"scenario": "chaos", "spec": args.chaos, "server_args": argv, "num_prompts": len(requests),
            "output_len": osl, "requests_lost": len(lost), "requests_failed": len(failed),
            "failures": sorted({r.error for r in failed} | {r.error or "too few tokens" for r in lost}),
            "texts_checked": len(checked), "texts_differing": len(differ), "clean_failed": sum(not r.success for r in clean),
            "clean_duration_s": round(clean_s, 2), "duration_s": round(duration, 2), "events": log,
            "phases": phases(results, faults, recovered, duration),
            "outside_recovery": outside_recovery(results, clean, faults, recovered, duration)}


def render(r: dict) -> str:
    lines = [f"{r['model']}: chaos {r['spec']!r}, {r['num_prompts']} requests of {r['output_len']} tokens "
             f"(no-fault run {r['clean_duration_s']} s, faulted run {r['duration_s']} s, load {r['load_avg_1m']})"]
    lines += [f"  {e}" for e in r["events"]]
    lines.append(f"lost {r['requests_lost']}, failed {r['requests_failed']}, texts equal to the no-fault run: "
                 f"{r['texts_checked'] - r['texts_differing']} of {r['texts_checked']} checked")
    lines += [f"  cause: {c}" for c in r["failures"]]
    lines.append(f"{'fault':<44}{'phase':>7}{'reqs':>6}{'TTFT p50':>10}{'p99':>8}{'TPOT p50':>10}{'p99':>8}  recovered")
    for p in r["phases"]:
        for name in ("before", "during", "after"):
            s = p[name]
            lines.append(f"{p['fault'] if name == 'before' else '':<44}{name:>7}{s['requests']:>6}"
                         f"{_f(s['ttft_p50_ms']):>10}{_f(s['ttft_p99_ms']):>8}{_f(s['tpot_p50_ms']):>10}"
                         f"{_f(s['tpot_p99_ms']):>8}  {_f(p['recovered_s']) + ' s' if name == 'during' else ''}")
    o = r.get("outside_recovery")
    if o:
        lines.append(f"outside the recovery windows ({o['requests']} requests): TTFT p99 {_f(o['ttft_p99_ms'])} ms "
                     f"({_f(o['ttft_p99_over_no_fault'])}x the no-fault run's {_f(o['no_fault_ttft_p99_ms'])}), TPOT p99 "
                     f"{_f(o['tpot_p99_ms'])} ms ({_f(o['tpot_p99_over_no_fault'])}x its {_f(o['no_fault_tpot_p99_ms'])})")
    return "\n".join(lines)


def _f(v) -> str:
    return "-" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)
