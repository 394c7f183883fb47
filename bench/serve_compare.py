"""What `atoll bench serve` puts beside its measured figures.

--compare-plan: the planner's steady-serving prediction (planner/serving.py) for the same
model config, layout (one replica), topology and workload: isl and osl the requests' mean
lengths; open loop at --request-rate (the planner's Poisson arrivals; the cache planned for
--max-num-seqs, or --max-concurrency if lower); closed loop at --max-concurrency when the rate
is inf; a burst (rate inf, no --max-concurrency) is costed as a closed loop at
min(requests, --max-num-seqs), the planner having no burst model. Predicted means beside the
measured means, as measured / predicted.

--compare-offline: the same requests through `atoll.LLM(model, ...).generate` in this process
(ranks started and two of the requests run before the timed calls), output tokens per second,
beside the server's, in --rounds rounds of both, the order alternating, both engines kept
running between them (an idle engine takes no CPU): the machine's load moves between rounds,
and the ratio of the medians weighs both sides alike.
"""

from __future__ import annotations

import math
import time

from atoll.bench.harness import sig


def plan_workload(*, isl: int, osl: int, requests: int, rate: float, max_concurrency: int | None,
                  max_num_seqs: int, dtype: str) -> tuple[dict, str]:
    """(Workload keywords, how the load was costed)."""
    kv = dict(isl=max(1, isl), osl=max(1, osl), dtype=dtype, kv_dtype=dtype)
    if not math.isinf(rate):
        c = min(max_num_seqs, max_concurrency or max_num_seqs)
        return kv | dict(concurrency=c, request_rate=rate), f"open loop at {rate:g} req/s (cache for {c})"
    if max_concurrency:
        return kv | dict(concurrency=max_concurrency), f"closed loop at concurrency {max_concurrency}"
    c = min(requests, max_num_seqs)
    return kv | dict(concurrency=c), f"a burst, costed as a closed loop at concurrency {c}"


def plan_prediction(model_dir: str, layout: str, topology: str, workload: dict) -> dict:
    """The planner's prediction for one replica of `layout` on `topology` (a preset or YAML)."""
    from atoll.bench.plan_check import topology_for
    from atoll.models.config import ModelConfig
    from atoll.parallel.layout import Layout
    from atoll.planner import Workload, plan_layouts
    from atoll.topologies import load_topology

    config = ModelConfig.load(model_dir)
    lay = Layout.parse(layout).validate(config)
    topo = topology_for(load_topology(topology), lay.world_size)
    plan = plan_layouts(config, topo, Workload(**workload), layouts=[f"1 x {lay}"])
    p = plan.predictions[0]
    return {"topology": topo.name, "layout": str(lay), "workload": {k: v for k, v in workload.items()},
            "ttft_ms": p.ttft_s * 1e3, "tpot_ms": p.tpot_s * 1e3, "sustainable": p.sustainable,
            "overload": p.overload, "fits": p.fits, "arrival_rate_per_s": p.arrival_rate,
            "output_tokens_per_s": p.tokens_per_s_per_gpu * p.gpus}


def versus_plan(measured: dict, predicted: dict) -> dict:
    """Measured means over predicted, for TTFT, TPOT and output tokens/s."""
    def ratio(m, p):
        return sig(m / p, 4) if m is not None and p and math.isfinite(p) else None

    return {"ttft": ratio(measured["ttft_ms"]["mean"], predicted["ttft_ms"]),
            "tpot": ratio(measured["tpot_ms"]["mean"], predicted["tpot_ms"]),
            "output_throughput": ratio(measured["output_throughput"], predicted["output_tokens_per_s"])}


class Offline:
    """The requests through LLM.generate with the bench's engine flags, on ranks started once
    (`with Offline(args, model_dir, warm) as off: off.measure(requests)`): started as the
    server's engine is (the living engine's spec, not one run's requests) and warmed as it
    is (two requests at once, untimed)."""

    def __init__(self, args, model_dir: str, warm):
        from atoll.launch.api import llm_from_args

        self.args, self.warm = args, warm
        self.llm = llm_from_args(args, model_dir)
        self.start_s = 0.0
        self.ranks: list[int] = []  # the processes the engine started (its ranks, forked by the fork server)

    def __enter__(self) -> "Offline":
        from atoll.config.sampling import SamplingParams

        import psutil

        t0 = time.perf_counter()
        before = {c.pid for c in psutil.Process().children(recursive=True)}
        try:
            self.llm.start()
            self.ranks = [c.pid for c in psutil.Process().children(recursive=True) if c.pid not in before]
            self.llm.generate([r.prompt for r in self.warm],
                              [SamplingParams(max_tokens=r.output_len, ignore_eos=self.args.ignore_eos)
                               for r in self.warm])
        except BaseException:
            self.llm.close()
            raise
        self.start_s = time.perf_counter() - t0
        return self

    def __exit__(self, *exc) -> None:
        self.llm.close()

    def measure(self, requests) -> dict:
        """Output tokens per second of one generate call of every request."""
        from atoll.config.sampling import SamplingParams

        from atoll.bench.serve_server import cpu_seconds

        params = [SamplingParams(max_tokens=r.output_len, ignore_eos=self.args.ignore_eos) for r in requests]
        ranks0, driver0 = self._ranks_cpu(cpu_seconds), time.process_time()
        t0 = time.perf_counter()
        outs = self.llm.generate([r.prompt for r in requests], params)
        wall = time.perf_counter() - t0
        cpu = {"driver": time.process_time() - driver0, "ranks": self._ranks_cpu(cpu_seconds) - ranks0}
        tokens = sum(len(o.token_ids) for o in outs)
        return {"requests": len(outs), "output_tokens": tokens, "duration_s": wall,
                "output_throughput": tokens / wall, "request_throughput": len(outs) / wall,
                "cpu_s": {k: round(v, 3) for k, v in cpu.items()}}

    def _ranks_cpu(self, cpu_seconds) -> float:
        return sum(cpu_seconds(pid, children=False) for pid in self.ranks)
