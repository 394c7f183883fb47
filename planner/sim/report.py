"""`atoll bench serve`'s figures from its requests' timings, as vLLM's benchmark_serving
defines them (pure functions: no I/O, no clock).

Per request: TTFT, send to the first streamed chunk; E2EL, send to the last chunk; ITL, the
gaps between successive chunks; TPOT, (E2EL - TTFT) / (output tokens - 1), for requests of
more than one output token (0 for goodput's purpose otherwise, as vLLM). The run's summary:
request and token throughput over the run's duration; mean and percentiles (numpy's linear
interpolation) of TTFT, TPOT (requests of more than one token), ITL (every gap of every
request, pooled) and E2EL; with SLOs (`--goodput ttft:MS tpot:MS e2el:MS`) the requests meeting
all of them (each metric <= its SLO): goodput in requests/s (vLLM's figure) and in output
tokens/s, and the attainment, the share of the requests sent that met every SLO (a failed
request meets none), and of each SLO alone.

KV cache tiers (tier_report): per tier the blocks read from it (hits), those looked for and not
found, its hit rate (its hits' tokens over the prompt tokens sent, as bench serve --scenario
kv-tiers counts it from /metrics), the seconds spent bringing blocks up from it, the blocks let
go of and held; beside them the prompt tokens sent and computed, as the engine's
atoll_kv_tier_* and atoll_prompt_tokens_* give them.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from atoll.errors import ConfigError

SLO_METRICS = ("ttft", "tpot", "e2el")
PERCENTILES = (50.0, 90.0, 99.0)


@dataclass
class RequestResult:
    """One request as the client saw it; times in seconds from its send."""

    success: bool = False
    prompt_tokens: int = 0  # the server's usage.prompt_tokens, else the tokens sent
    output_tokens: int = 0  # the server's usage.completion_tokens, else the chunks received
    ttft: float = 0.0
    latency: float = 0.0  # E2EL
    itl: list[float] = field(default_factory=list)
    start: float = 0.0  # when it was sent, seconds from the run's start
    error: str = ""
    usage: bool = False  # whether the token counts came from the server's usage

    @property
    def tpot(self) -> float:
        """(E2EL - TTFT) / (output tokens - 1); 0 for a request of one token (vLLM)."""
        if self.output_tokens > 1:
            return (self.latency - self.ttft) / (self.output_tokens - 1)
        return 0.0


def percentile(values, p: float) -> float | None:
    """The p-th percentile (0-100) by linear interpolation between the closest ranks, as
    numpy.percentile's default; None for no values."""
    xs = sorted(values)
    if not xs:
        return None
    if not 0 <= p <= 100:
        raise ValueError(f"percentile {p} is outside 0..100")
    rank = p / 100 * (len(xs) - 1)
    lo = math.floor(rank)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (rank - lo)


def summarize(values_s, percentiles=PERCENTILES) -> dict:
    """{"mean": ms, "p50": ms, ...} of values in seconds; None each for no values."""
    xs = list(values_s)
    out = {"mean": sum(xs) / len(xs) * 1e3 if xs else None}
    for p in percentiles:
        v = percentile(xs, p)
        out[pct_name(p)] = None if v is None else v * 1e3
    return out


def pct_name(p: float) -> str:
    return f"p{p:g}".replace(".", "_")


def parse_percentiles(text: str) -> tuple[float, ...]:
    """"50,90,99" -> (50.0, 90.0, 99.0) (vLLM's --metric-percentiles)."""
    try:
        ps = tuple(float(x) for x in str(text).split(",") if x.strip())
    except ValueError:
        raise ConfigError(f"--metric-percentiles {text!r}: expected numbers like 50,90,99") from None
    if not ps or not all(0 < p < 100 for p in ps):
        raise ConfigError(f"--metric-percentiles {text!r}: each must lie strictly between 0 and 100")
    return ps


def parse_goodput(items) -> dict[str, float]:
    """["ttft:200", "tpot:50"] -> {"ttft": 200.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        name, sep, value = str(item).partition(":")
        name = name.strip().lower()
        if not sep or name not in SLO_METRICS:
            raise ConfigError(f"--goodput {item!r}: expected METRIC:MS with METRIC one of {', '.join(SLO_METRICS)}")
        try:
            ms = float(value)
        except ValueError:
            raise ConfigError(f"--goodput {item!r}: {value!r} is not a number of milliseconds") from None
        if not 0 < ms < math.inf:
            raise ConfigError(f"--goodput {item!r}: an SLO must be a positive number of milliseconds")
        if name in slos:
            raise ConfigError(f"--goodput: {name} is given twice")
        slos[name] = ms
    return slos


def slo_values(r: RequestResult) -> dict[str, float]:
    """A request's SLO metrics in milliseconds."""
    return {"ttft": r.ttft * 1e3, "tpot": r.tpot * 1e3, "e2el": r.latency * 1e3}


def meets(r: RequestResult, slos: dict[str, float]) -> bool:
    """Whether a successful request meets every SLO (metric <= SLO, vLLM's test)."""
    if not r.success:
        return False
    v = slo_values(r)
    return all(v[name] <= ms for name, ms in slos.items())


def goodput(results: list[RequestResult], slos: dict[str, float], duration_s: float) -> dict:
    """Requests meeting every SLO: their count, requests/s and output tokens/s over the run,
    the attainment (their share of the requests sent) and each SLO's own attainment."""
    good = [r for r in results if meets(r, slos)]
    sent = len(results)
    each = {name: sum(meets(r, {name: ms}) for r in results) / sent if sent else None for name, ms in slos.items()}
    return {"slos_ms": dict(slos), "good_requests": len(good),
            "request_goodput": len(good) / duration_s if duration_s > 0 else None,
            "output_token_goodput": sum(r.output_tokens for r in good) / duration_s if duration_s > 0 else None,
            "attainment": len(good) / sent if sent else None, "attainment_by_slo": each}


def report(results: list[RequestResult], duration_s: float, *, slos: dict[str, float] | None = None,
           percentiles=PERCENTILES) -> dict:
    """The run's summary (module docstring); duration_s: first send to last response."""
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_tokens for r in ok)
    total_out = sum(r.output_tokens for r in ok)
    rate = (lambda x: x / duration_s) if duration_s > 0 else (lambda x: None)
    out = {
        "requests": len(results), "completed": len(ok), "failed": len(results) - len(ok),
        "duration_s": duration_s, "total_input_tokens": total_in, "total_output_tokens": total_out,
        "request_throughput": rate(len(ok)), "output_throughput": rate(total_out),
        "total_token_throughput": rate(total_in + total_out),
        "token_counts_from_usage": all(r.usage for r in ok) if ok else None,
        "ttft_ms": summarize([r.ttft for r in ok], percentiles),
        "tpot_ms": summarize([r.tpot for r in ok if r.output_tokens > 1], percentiles),
        "itl_ms": summarize([g for r in ok for g in r.itl], percentiles),
        "e2el_ms": summarize([r.latency for r in ok], percentiles),
    }
    if slos:
        out["goodput"] = goodput(results, slos, duration_s)
    errors = sorted({r.error for r in results if not r.success and r.error})
    if errors:
        out["errors"] = errors[:5]
    return out


def num(v, digits: int = 2) -> str:
    """A figure for a table: `digits` decimals, "-" for none."""
    return "-" if v is None else f"{v:.{digits}f}"


def report_lines(s: dict) -> list[str]:
    """A report's lines as `atoll bench serve` and `atoll simulate` print them: counts,
    throughput, the metrics' table, and SLO attainment and goodput when asked for."""
    lines = [f"  completed {s['completed']}, failed {s['failed']}, duration {s['duration_s']:.2f} s, "
             f"{s['total_input_tokens']} input / {s['total_output_tokens']} output tokens"
             + ("" if s["token_counts_from_usage"] is not False else " (output counted as chunks: no usage)"),
             f"  request throughput {num(s['request_throughput'])} req/s, output {num(s['output_throughput'])} tok/s, "
             f"total {num(s['total_token_throughput'])} tok/s"]
    keys = [k for k in s["ttft_ms"]]
    lines.append(f"  {'ms':<6}" + "".join(f"{k:>10}" for k in keys))
    for m in ("ttft", "tpot", "itl", "e2el"):
        lines.append(f"  {m.upper():<6}" + "".join(f"{num(s[m + '_ms'][k]):>10}" for k in keys))
    if "goodput" in s:
        g = s["goodput"]
        slo = " ".join(f"{k}:{v:g}" for k, v in g["slos_ms"].items())
        each = ", ".join(f"{k} {num(v, 3)}" for k, v in g["attainment_by_slo"].items())
        lines.append(f"  SLOs {slo} ms: attainment {num(g['attainment'], 3)} ({each}); goodput "
                     f"{num(g['request_goodput'])} req/s, {num(g['output_token_goodput'])} output tok/s")
    return lines


def tier_report(counts: dict, *, prompt_tokens: int, prompt_computed: int, block_size: int) -> dict:
    """The tiers' figures (module docstring) from each tier's counters (hits, misses, evictions,
    fetch_seconds, blocks; planner/sim/tiers.py) and the writes dropped."""
    tiers = {}
    for name, c in counts.items():
        if not isinstance(c, dict):
            continue
        tiers[name] = {"hits": c["hits"], "misses": c["misses"],
                       "hit_rate": c["hits"] * block_size / prompt_tokens if prompt_tokens else None,
                       "fetch_s": c["fetch_seconds"], "evictions": c["evictions"], "blocks": c["blocks"]}
    return {"tiers": tiers, "writes_dropped": counts.get("writes_dropped", 0), "prompt_tokens": prompt_tokens,
            "prompt_tokens_computed": prompt_computed}


def tier_lines(t: dict) -> list[str]:
    """tier_report's lines, as `atoll simulate` prints them."""
    lines = [f"  prompt tokens {t['prompt_tokens']}, computed {t['prompt_tokens_computed']}"
             + (f"; {t['writes_dropped']} tier writes dropped (a full write queue)" if t["writes_dropped"] else "")]
    for name, x in t["tiers"].items():
        lines.append(f"  KV tier {name}: {x['hits']} blocks read (hit rate {num(x['hit_rate'], 3)}), "
                     f"{x['misses']} missed, {x['fetch_s'] * 1e3:.1f} ms bringing them up, "
                     f"{x['evictions']} let go of, {x['blocks']} held at the end")
    return lines

