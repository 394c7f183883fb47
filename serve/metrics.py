"""The server's Prometheus metrics, in a registry of its own (prometheus_client).

Latencies are measured in the server, from a request's arrival to the moment the engine's
thread handed over each token. Running, waiting and KV blocks are the engine's own counters
(the ranks report them every pass), read at each scrape.
"""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

PREFIX = "atoll"
# seconds: from a millisecond (a GPU decode step) to minutes (a long prompt behind a queue)
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
                   2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)

# name -> what it measures (docs/serving.md lists these)
DESCRIPTIONS = {
    "time_to_first_token_seconds": "from a request's arrival to its first token",
    "inter_token_latency_seconds": "between two consecutive tokens of a request",
    "e2e_request_latency_seconds": "from a request's arrival to its last token",
    "num_requests_running": "requests the engine is running (prefill or decode)",
    "num_requests_waiting": "requests queued in the engine for a place in the batch",
    "kv_blocks_in_use": "KV cache blocks held by running requests, all replicas",
    "kv_blocks_cached": "KV cache blocks no request holds that keep a cached prefix",
    "kv_blocks_total": "KV cache blocks, all replicas",
    "kv_window_blocks_in_use": "the sliding-window layers' own KV blocks held by running requests (a model whose "
                               "sliding layers sit beside full-attention ones; 0 otherwise)",
    "kv_window_blocks_total": "the sliding-window layers' own KV blocks, all replicas (0: none of their own)",
    "prefix_cache_hit_rate": "prompt tokens served from the prefix cache / prompt tokens, since start",
    "prompt_tokens_total": "prompt tokens of finished requests",
    "prompt_tokens_cached_total": "of those, served from the prefix cache",
    "generation_tokens_total": "tokens generated",
    "requests_finished_total": "requests that ended, by finish_reason (stop, length, abort)",
    "requests_failed_total": "requests answered with an error, by reason (invalid, rejected, engine, shutdown)",
    "spec_decode_num_drafts_total": "speculative decoding: verify steps of a request that checked a draft",
    "spec_decode_num_draft_tokens_total": "speculative decoding: tokens drafted",
    "spec_decode_num_accepted_tokens_total": "speculative decoding: drafted tokens the target model kept",
    "spec_decode_acceptance_rate": "speculative decoding: accepted / drafted tokens, since start",
    "spec_decode_mean_accepted_length": "speculative decoding: tokens per verify step (accepted drafts + 1), "
                                        "since start",
    "kv_tier_blocks": "KV cache tiers: blocks a tier holds (host, disk; the shared store's own count is its server's)",
    "kv_tier_bytes": "KV cache tiers: bytes a tier holds",
    "kv_tier_hits": "KV cache tiers: blocks read from a tier, since start",
    "kv_tier_misses": "KV cache tiers: blocks looked for in a tier and not found, since start",
    "kv_tier_bytes_in": "KV cache tiers: bytes written to a tier, since start",
    "kv_tier_bytes_out": "KV cache tiers: bytes read from a tier, since start",
    "kv_tier_evictions": "KV cache tiers: blocks a tier let go of for room, since start",
    "kv_tier_fetch_seconds": "KV cache tiers: seconds spent reading blocks from a tier to bring them up, since start",
    "kv_tier_checksum_misses": "KV cache tiers: blocks found torn, truncated, corrupt or another model's, "
                               "each read as a miss and computed again",
    "kv_tier_writes_dropped": "KV cache tiers: blocks no tier could take (a full write queue or every tier off)",
    "kv_events_published": "KV cache events the engines sent the router, since start: a block named (stored) "
                           "or evicted from a device pool (a replica with tiers keeps an evicted block below it)",
    "expert_load_max_mean": "MoE: each layer's max/mean tokens per EP rank over the expert load window "
                            "(--eplb-window-size steps; 1.0 is even), by layer, as of the last report "
                            "(every --expert-load-interval steps)",
    "expert_load_max_mean_worst": "MoE: the worst layer's max/mean tokens per EP rank over the window",
    "eplb_rebalances": "MoE with --enable-eplb: rebalances of the experts' placement since start",
    "disagg_routed": "disaggregated serving: requests by the path decided at arrival (prefill: to the prefill "
                     "engines; decode: short or cached enough to stay; queue: the prefill engines were full; "
                     "colocated: taken by a --colocated-replicas decode engine)",
    "disagg_requests_total": "disaggregated serving: requests that ended, by the engine that computed their "
                             "prompt (prefill: the prefill engine, its KV sent; decode: the decode engine itself)",
    "disagg_migrations": "disaggregated serving: requests moved with their tokens off a prefill or decode engine "
                         "that died, onto a live decode engine, since start (a whole job started "
                         "again counts in atoll_router_migrations instead)",
}

# the replicas' router (serve.replicas), atoll_router_<name>
ROUTER_HELP = {
    "requests": "requests sent to a replica, by replica and reason (prefix: the longest cached prefix; least_loaded: "
                "no replica held one; balance: the best one was a batch busier than the least loaded; round_robin; "
                "copy: a copy of a request, n > 1, to its first copy's replica; a retry counts again)",
    "retries": "requests sent again to another replica because theirs died (migrations counts those of them that "
               "had streamed tokens)",
    "prompt_tokens": "prompt tokens of the requests routed",
    "prefix_hit_tokens": "of those, the tokens the router expected the chosen replica to hold in its prefix cache",
    "replica_up": "1 while the replica serves, 0 once its ranks died",
    "migrations": "requests that had streamed tokens when their replica died, continued on another with those tokens",
    "replica_restarts": "replicas started again after their ranks died",
    "prefix_hit_rate": "router's expected prefix hits / prompt tokens routed, since start",
}


class _LayerLoad:
    """atoll_expert_load_max_mean{layer}: a gauge per MoE layer, the layers read at each scrape."""

    def __init__(self, load):
        self.load = load

    def collect(self):
        g = GaugeMetricFamily(f"{PREFIX}_expert_load_max_mean", DESCRIPTIONS["expert_load_max_mean"],
                              labels=["layer"])
        for layer, entry in self.load().get("layers", {}).items():
            g.add_metric([str(layer)], entry["max_mean"])
        yield g


class _StatsCounter:
    """A counter the engine keeps (its stats()[key]), exposed as a Prometheus counter at each scrape."""

    def __init__(self, name: str, key: str, stats):
        self.name, self.key, self.stats = name, key, stats

    def collect(self):
        yield CounterMetricFamily(f"{PREFIX}_{self.name}", DESCRIPTIONS[self.name],
                                  value=self.stats().get(self.key, 0))


class Metrics:
    def __init__(self, stats=lambda: {}):
        """stats(): the engine's counters (running, waiting, blocks_in_use, ...)."""
        self.registry = r = CollectorRegistry()
        d = DESCRIPTIONS
        self.ttft = Histogram(f"{PREFIX}_time_to_first_token_seconds", d["time_to_first_token_seconds"],
                              buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram(f"{PREFIX}_inter_token_latency_seconds", d["inter_token_latency_seconds"],
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram(f"{PREFIX}_e2e_request_latency_seconds", d["e2e_request_latency_seconds"],
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter(f"{PREFIX}_prompt_tokens", d["prompt_tokens_total"], registry=r)
        self.cached_tokens = Counter(f"{PREFIX}_prompt_tokens_cached", d["prompt_tokens_cached_total"], registry=r)
        self.generation_tokens = Counter(f"{PREFIX}_generation_tokens", d["generation_tokens_total"], registry=r)
        self.finished = Counter(f"{PREFIX}_requests_finished", d["requests_finished_total"], ["finish_reason"],
                                registry=r)
        self.failed = Counter(f"{PREFIX}_requests_failed", d["requests_failed_total"], ["reason"], registry=r)
        self.disagg = Counter(f"{PREFIX}_disagg_requests", d["disagg_requests_total"], ["path"], registry=r)
        self.spec = {key: Counter(f"{PREFIX}_spec_decode_num_{key}", d[f"spec_decode_num_{key}_total"], registry=r)
                     for key in ("drafts", "draft_tokens", "accepted_tokens")}
        self._spec = {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
        Gauge(f"{PREFIX}_spec_decode_acceptance_rate", d["spec_decode_acceptance_rate"], registry=r).set_function(
            lambda: self._spec["accepted_tokens"] / self._spec["draft_tokens"] if self._spec["draft_tokens"] else 0.0)
        Gauge(f"{PREFIX}_spec_decode_mean_accepted_length", d["spec_decode_mean_accepted_length"],
              registry=r).set_function(self.mean_accepted_length)
        for reason in ("stop", "length", "abort"):
            self.finished.labels(reason)
        for reason in ("invalid", "rejected", "engine", "shutdown"):
            self.failed.labels(reason)
        for name, key in (("num_requests_running", "running"), ("num_requests_waiting", "waiting"),
                          ("kv_blocks_in_use", "blocks_in_use"), ("kv_blocks_cached", "blocks_cached"),
                          ("kv_blocks_total", "num_blocks"), ("kv_window_blocks_in_use", "window_blocks_in_use"),
                          ("kv_window_blocks_total", "window_num_blocks")):
            Gauge(f"{PREFIX}_{name}", d[name], registry=r).set_function(lambda key=key: stats().get(key, 0))
        for counter in ("blocks", "bytes", "hits", "misses", "bytes_in", "bytes_out", "evictions", "fetch_seconds"):
            g = Gauge(f"{PREFIX}_kv_tier_{counter}", d[f"kv_tier_{counter}"], ["tier"], registry=r)
            for tier in ("host", "disk", "shared"):
                g.labels(tier).set_function(lambda k=f"kv_tier_{tier}_{counter}": stats().get(k, 0))
        for name in ("kv_tier_checksum_misses", "kv_tier_writes_dropped", "kv_events_published"):
            Gauge(f"{PREFIX}_{name}", d[name], registry=r).set_function(lambda k=name: stats().get(k, 0))
        Gauge(f"{PREFIX}_prefix_cache_hit_rate", d["prefix_cache_hit_rate"], registry=r).set_function(self.hit_rate)
        load = lambda: stats().get("expert_load") or {}  # noqa: E731  (engine/rank/eplb.py's report)
        Gauge(f"{PREFIX}_expert_load_max_mean_worst", d["expert_load_max_mean_worst"],
              registry=r).set_function(lambda: load().get("max_mean", 0.0))
        Gauge(f"{PREFIX}_eplb_rebalances", d["eplb_rebalances"], registry=r).set_function(
            lambda: load().get("rebalances", 0))
        r.register(_LayerLoad(load))
        routed = Gauge(f"{PREFIX}_disagg_routed", d["disagg_routed"], ["decision"], registry=r)
        for decision in ("prefill", "decode", "queue", "colocated"):
            routed.labels(decision).set_function(lambda k=decision: stats().get("routed", {}).get(k, 0))
        r.register(_StatsCounter("disagg_migrations", "migrations", stats))
        self._prompt = self._cached = 0

    def mean_accepted_length(self) -> float:
        """Tokens a speculative verify step gave a request: its accepted drafts and one more."""
        s = self._spec
        return (s["accepted_tokens"] + s["drafts"]) / s["drafts"] if s["drafts"] else 0.0

    def hit_rate(self) -> float:
        return self._cached / self._prompt if self._prompt else 0.0

    def request_finished(self, result: dict, *, arrived: float, now: float) -> None:
        m = result.get("metrics", {})
        prompt, cached = m.get("prompt_tokens", 0), m.get("cached_tokens", 0) or 0
        self._prompt += prompt
        self._cached += cached
        self.prompt_tokens.inc(prompt)
        self.cached_tokens.inc(cached)
        self.finished.labels(result.get("finish_reason") or "abort").inc()
        for key, field in (("drafts", "spec_steps"), ("draft_tokens", "spec_drafted"),
                           ("accepted_tokens", "spec_accepted")):
            self._spec[key] += m.get(field, 0)
            self.spec[key].inc(m.get(field, 0))
        if "prefilled_on" in m:
            self.disagg.labels(m["prefilled_on"]).inc()
        self.e2e.observe(now - arrived)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST
