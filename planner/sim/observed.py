"""Correction from a running server (`atoll plan --goodput ... --from-metrics URL`), as NVIDIA
Dynamo's planner corrects its predictions: the server's /metrics give its measured mean TTFT
and inter-token latency since it started, and the simulator's run of the deployment it serves
(`--serving`) under the load it saw gives the predicted ones. Their ratios then scale every
simulated TTFT (TTFT) and TPOT, ITL and E2EL (ITL): the SLOs a simulated run must meet are
divided by them, and its figures multiplied.
"""

from __future__ import annotations

import urllib.error
import urllib.request
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from atoll.errors import ConfigError

PREFIX = "atoll"  # serve/metrics.py's names
TIMEOUT_S = 10.0
MIN_REQUESTS = 10  # fewer finished requests than this measure nothing worth correcting by


@dataclass(frozen=True)
class Observed:
    """A server's means since it started."""
    url: str
    requests: int  # finished (its E2E histogram's count)
    ttft_s: float
    itl_s: float
    isl: float  # prompt tokens per finished request
    osl: float  # generated tokens per finished request


def read_metrics(url: str, *, timeout_s: float = TIMEOUT_S) -> Observed:
    """The server's /metrics (URL of the server or of its /metrics); one line for any failure."""
    target = url.rstrip("/")
    if not target.endswith("/metrics"):
        target += "/metrics"
    try:
        with urllib.request.urlopen(target, timeout=timeout_s) as r:  # noqa: S310 (a URL the user gave)
            text = r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        raise ConfigError(f"--from-metrics {target}: HTTP {e.code}") from None
    except (urllib.error.URLError, OSError, ValueError) as e:
        raise ConfigError(f"--from-metrics {target}: {getattr(e, 'reason', None) or e}") from None
    return parse_metrics(text, target)


def parse_metrics(text: str, where: str = "metrics") -> Observed:
    sums: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name.startswith(PREFIX + "_"):
                    sums[s.name] = sums.get(s.name, 0.0) + s.value
    except ValueError as e:
        raise ConfigError(f"--from-metrics {where}: not Prometheus text ({e})") from None

    def mean(hist: str) -> tuple[float, float]:
        n = sums.get(f"{PREFIX}_{hist}_count")
        if n is None:
            raise ConfigError(f"--from-metrics {where}: no {PREFIX}_{hist} (is it an atoll server?)")
        return (sums.get(f"{PREFIX}_{hist}_sum", 0.0) / n if n else 0.0), n

    ttft, _ = mean("time_to_first_token_seconds")
    itl, _ = mean("inter_token_latency_seconds")
    _, done = mean("e2e_request_latency_seconds")
    if done < MIN_REQUESTS:
        raise ConfigError(f"--from-metrics {where}: {int(done)} requests finished; at least {MIN_REQUESTS} "
                          "are needed to correct by")
    return Observed(where, int(done), ttft, itl, sums.get(f"{PREFIX}_prompt_tokens_total", 0.0) / done,
                    sums.get(f"{PREFIX}_generation_tokens_total", 0.0) / done)


def factors(observed: Observed, predicted: dict) -> dict[str, float]:
    """{"ttft", "itl"}: measured over predicted means (predicted: report.report's figures)."""
    out = {}
    for key, measured, name in (("ttft", observed.ttft_s, "ttft_ms"), ("itl", observed.itl_s, "itl_ms")):
        sim = predicted[name]["mean"]
        if not sim or not measured:
            raise ConfigError(f"--from-metrics: no {key.upper()} to compare (measured {measured}, simulated {sim})")
        out[key] = measured * 1e3 / sim
    return out


def corrected_slos(slos: dict, f: dict) -> dict:
    """The SLOs a simulated run must meet so that its corrected figures meet the real ones."""
    scale = {"ttft": f["ttft"], "tpot": f["itl"], "e2el": f["itl"]}
    return {k: v / scale[k] for k, v in slos.items()}


def corrected(serve: dict, f: dict) -> dict:
    """A simulated report's latency figures times the factors (a copy)."""
    out = dict(serve)
    for name, key in (("ttft_ms", "ttft"), ("tpot_ms", "itl"), ("itl_ms", "itl"), ("e2el_ms", "itl")):
        out[name] = {k: (None if v is None else v * f[key]) for k, v in serve[name].items()}
    return out
