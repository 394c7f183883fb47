"""`atoll bench serve --scenario kv-tiers`: multi-turn chat on a device pool too small for it,
served four ways in one run: no KV tiers, a host-memory tier, host memory plus a disk
directory (engine/rank/kv_tiers.py), and a restart: a new server on that side's disk directory,
given the same conversations again, whose first turns find their prompts on disk (their cached
tokens and TTFT beside the cold server's first turns).

--num-prompts conversations of --turns turns each, --max-concurrency requests in flight (default
8): every conversation sends its first turn at once, and each later turn queues behind the turns
already waiting, as users who come back after a pause do, so a conversation's history has to
outlast the others' turns to be found again. A conversation's first prompt is --input-len random token ids; each later turn's prompt
holds the whole history: the last prompt, the answer the server gave (its token ids), and
--user-len new ids. Answers are --output-len greedy tokens. Every side gets the same first
prompts and new ids, so its greedy answers, and so every prompt, must match the others'.

Per side: TTFT p50 and p90 of turns 2 and later (the turns whose history could be cached), of
first turns, and the tokens the first turns' answers said were cached (usage),
prompt tokens computed (prompt less cached, from /metrics), and where the cached ones came from:
the device pool, or a tier (its hits x the block size; the first rank's tiers).
"""

from __future__ import annotations

import asyncio
import random
import tempfile
import time

from atoll.bench.harness import sig
from atoll.bench.serve_load import payload, send, served_model, warm_up
from atoll.bench.serve_routing import scrape
from atoll.bench.serve_server import Server, engine_argv
from atoll.errors import ConfigError
from atoll.planner.sim.load import BenchRequest, random_requests
from atoll.planner.sim.report import percentile

TIERS = ("host", "disk", "shared")


def sides(args, disk_dir: str) -> dict[str, dict]:
    """Each side's tier flags (engine field -> value) on top of the bench's engine flags."""
    host = args.kv_offload_gb or 1.0
    disk = {"kv_offload_gb": host, "kv_disk_dir": disk_dir, "kv_shared": None}
    return {"no tiers": {"kv_offload_gb": 0.0, "kv_disk_dir": None, "kv_shared": None},
            "host": {"kv_offload_gb": host, "kv_disk_dir": None, "kv_shared": None},
            "host + disk": disk, "restart on disk": disk}


async def conversations(url: str, model: str, firsts: list[list[int]], news: list[list[list[int]]], *,
                        output_len: int, concurrency: int, timeout_s: float) -> list[list]:
    """Each conversation's turns in order, `concurrency` requests in flight: per turn
    (RequestResult, answer token ids, the tokens its usage said were cached)."""
    import httpx  # lazy: the optional atoll[serve]

    endpoint = url.rstrip("/") + "/v1/completions"
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0), limits=limits) as client:
        async def one(first: list[int], later: list[list[int]]) -> list:
            out, prompt = [], list(first)
            for turn, new in enumerate([None] + later):
                if turn:
                    prompt = prompt + out[-1][1] + new
                answer: list[int] = []
                usage: dict = {}
                async with sem:  # a place per request: the next turn queues behind the others' turns
                    res = await send(client, endpoint, payload(model, BenchRequest(prompt, output_len)),
                                     prompt_len=len(prompt), token_ids=answer, usage=usage)
                cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                out.append((res, answer, int(cached)))
                if not res.success:
                    break
            return out

        return list(await asyncio.gather(*(one(f, n) for f, n in zip(firsts, news))))


def side_figures(turns: list[list], before: dict, after: dict, block_size: int, seconds: float) -> dict:
    """One side's figures from its turns and the /metrics difference."""
    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    later = [r.ttft * 1e3 for conv in turns for r, *_ in conv[1:] if r.success]
    firsts = [conv[0] for conv in turns if conv and conv[0][0].success]
    failed = [r.error for conv in turns for r, *_ in conv if not r.success]
    prompt, cached = delta("atoll_prompt_tokens_total"), delta("atoll_prompt_tokens_cached_total")
    from_tier = {t: delta(f'atoll_kv_tier_hits{{tier="{t}"}}') * block_size for t in TIERS}
    device = cached - sum(from_tier.values())
    share = lambda x: sig(x / prompt, 4) if prompt else None  # noqa: E731
    return {"turns": sum(len(c) for c in turns), "failed": len(failed), "errors": failed[:3],
            "ttft_ms_later_turns": {"p50": sig(percentile(later, 50), 4), "p90": sig(percentile(later, 90), 4)},
            "ttft_ms_first_turns": {"p50": sig(percentile([r.ttft * 1e3 for r, *_ in firsts], 50), 4),
                                    "p90": sig(percentile([r.ttft * 1e3 for r, *_ in firsts], 90), 4)},
            "first_turns_cached_tokens": sum(c for *_, c in firsts),
            "prompt_tokens": int(prompt), "prefill_tokens_computed": int(prompt - cached),
            "hit_rate": {"device": share(device), **{t: share(v) for t, v in from_tier.items() if v}},
            "checksum_misses": int(delta("atoll_kv_tier_checksum_misses")), "duration_s": round(seconds, 2)}


def run_tiers(args, bench, model_dir: str, vocab_size: int) -> dict:
    """The three sides (module docstring), each on a server of its own, one after another."""
    if args.url:
        raise ConfigError("--scenario kv-tiers starts its own servers (one per side): drop --url")
    if args.turns < 2:
        raise ConfigError(f"--turns {args.turns} must be at least 2")
    osl = args.output_len or 32
    rng = random.Random(args.seed)
    ids = lambda n: [rng.randrange(1, vocab_size - 1) for _ in range(n)]  # noqa: E731
    firsts = [ids(args.input_len) for _ in range(args.num_prompts)]
    news = [[ids(args.user_len) for _ in range(args.turns - 1)] for _ in range(args.num_prompts)]
    warm = random_requests(2, input_len=args.user_len, output_len=osl, vocab_size=vocab_size, seed=args.seed + 7)
    concurrency = args.max_concurrency or 8
    out, answers = {}, {}
    with tempfile.TemporaryDirectory(prefix="atoll-kv-disk-", dir=args.kv_disk_dir) as disk:
        for name, flags in sides(args, disk + "/tier").items():
            argv = engine_argv(args, **flags)
            with Server(model_dir, argv, ready_timeout_s=args.server_timeout) as url:
                model = served_model(url, model_dir)
                warm_up(url, model, warm, args)
                before, t0 = scrape(url), time.perf_counter()
                turns = asyncio.run(conversations(url, model, firsts, news, output_len=osl, concurrency=concurrency,
                                                  timeout_s=args.timeout))
                seconds, after = time.perf_counter() - t0, scrape(url)
            bench.note()
            out[name] = side_figures(turns, before, after, args.block_size, seconds) | {
                "load_avg_1m_after": round(bench.loads[-1], 2), "server_args": argv}
            answers[name] = [[a for _, a, _ in conv] for conv in turns]
    first = next(iter(answers.values()))
    return {"scenario": "kv-tiers", "conversations": args.num_prompts, "turns": args.turns,
            "input_len": args.input_len, "user_len": args.user_len, "output_len": osl,
            "concurrency": concurrency, "num_blocks": args.num_blocks, "sides": out,
            "same_answers": all(a == first for a in answers.values())}


def render(r: dict) -> str:
    lines = [f"{r['model']}: {r['conversations']} conversations x {r['turns']} turns ({r['input_len']} tokens, then "
             f"+{r['output_len']} answer +{r['user_len']} user a turn), {r['concurrency']} at once, "
             f"--num-blocks {r['num_blocks']}"]
    lines.append(f"{'side':<16}{'TTFT p50':>9}{'TTFT p90':>9}{'prefill tok':>12}  hit rate by tier"
                 f"{'':>14}{'turn 1 TTFT p50/p90, cached':>29}{'failed':>7}{'load':>6}")
    for name, s in r["sides"].items():
        t, f = s["ttft_ms_later_turns"], s["ttft_ms_first_turns"]
        hits = ", ".join(f"{k} {v:.1%}" for k, v in s["hit_rate"].items() if v is not None)
        first = f"{f['p50'] or 0:.0f}/{f['p90'] or 0:.0f} ms, {s['first_turns_cached_tokens']}"
        lines.append(f"{name:<16}{t['p50'] or 0:>9.0f}{t['p90'] or 0:>9.0f}{s['prefill_tokens_computed']:>12}  "
                     f"{hits:<30}{first:>29}{s['failed']:>7}{s['load_avg_1m_after']:>6}")
        for e in s["errors"]:
            lines.append(f"  error: {e}")
    lines.append("TTFT of turns 2 and later, ms; greedy answers the same on every side: "
                 f"{'yes' if r['same_answers'] else 'NO'}")
    return "\n".join(lines)
