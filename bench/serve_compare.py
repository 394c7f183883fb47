"""What `atoll bench serve` puts beside its measured figures.

--compare-plan also runs the simulator (planner/sim) on the same requests, arrivals and engine
flags, and gives measured over simulated figure by figure; with speculation the round's own
drafting (acceptance and draft rate, from the server's /metrics) goes to the simulator.

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
from pathlib import Path

import psutil

from atoll.bench.harness import sig
from atoll.bench.serve_probe import scaled_topology
from atoll.bench.serve_routing import scrape
from atoll.bench.serve_server import cpu_seconds
from atoll.config import from_args
from atoll.config.sampling import SamplingParams
from atoll.errors import AtollError
from atoll.launch.device import decide
from atoll.models.config import ModelConfig
from atoll.parallel.layout import Layout, resolve_layout
from atoll.planner import Workload, plan_layouts
from atoll.planner.sim.api import simulate
from atoll.planner.sim.deploy import RUNTIME_DTYPES, from_engine_flags
from atoll.planner.sim.load import tokenized
from atoll.planner.sim.report import num, report_lines
from atoll.topologies import load_topology


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
    # lazy: plan_check imports torch (its --check runs ranks); atoll simulate imports this module
    # and runs without torch
    from atoll.bench.plan_check import topology_for

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
        from atoll.launch.api import llm_from_args  # lazy: torch; atoll simulate imports this module without it

        self.args, self.warm = args, warm
        self.llm = llm_from_args(args, model_dir)
        self.start_s = 0.0
        self.ranks: list[int] = []  # the processes the engine started (its ranks, forked by the fork server)

    def __enter__(self) -> "Offline":
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


SPEC_COUNTERS = ("drafts", "draft_tokens", "accepted_tokens")


def spec_counts(url: str) -> dict[str, float]:
    """The server's speculative decoding counters (/metrics)."""
    m = scrape(url)
    return {k: m.get(f"atoll_spec_decode_num_{k}_total", 0.0) for k in SPEC_COUNTERS}


def spec_rates(before: dict, after: dict, rep: dict) -> dict:
    """A round's drafting as the simulator takes it: the share of drafted tokens kept, and the
    share of decode steps that drafted (steps: output tokens less each request's first and the
    accepted drafts)."""
    d = {k: after[k] - before[k] for k in SPEC_COUNTERS}
    steps = rep["total_output_tokens"] - rep["completed"] - d["accepted_tokens"]
    return {"acceptance": d["accepted_tokens"] / d["draft_tokens"] if d["draft_tokens"] else 0.0,
            "draft_rate": min(1.0, d["drafts"] / steps) if steps > 0 else 0.0, **d}


def compare_plan(args, model_dir: str, config, requests, measured: dict, *, slos: dict, percentiles,
                 spec: dict | None = None, speed: dict | None = None) -> dict:
    """--compare-plan: the analytic prediction and the simulation of the same load beside the
    measured figures; spec: the round's measured drafting (spec_rates), for the simulator; speed:
    the speed probe's report (bench/serve_probe.py), whose factor scales the calibration's steps."""
    layout = resolve_layout(args.layout, args.tensor_parallel_size, args.pipeline_parallel_size,
                            args.data_parallel_size, args.expert_parallel_size,
                            getattr(args, "context_parallel_size", None))
    n = measured["completed"]  # the mean lengths the server counted, else those sent
    if n:
        isl, osl = round(measured["total_input_tokens"] / n), round(measured["total_output_tokens"] / n)
    else:
        isl = round(sum(r.prompt_len or 0 for r in requests) / len(requests))
        osl = round(sum(r.output_len for r in requests) / len(requests))
    on_cpu = args.url is None and decide(from_args(args).device, 0) == "cpu"
    dtype = RUNTIME_DTYPES.get(args.dtype or "", "fp32" if on_cpu else "auto")
    workload, costed = plan_workload(isl=isl, osl=osl, requests=len(requests), rate=args.request_rate,
                                     max_concurrency=args.max_concurrency, max_num_seqs=args.max_num_seqs, dtype=dtype)
    out = {"costed_as": costed}
    try:
        predicted = plan_prediction(model_dir, str(layout), args.topology, workload)
        out |= {"predicted": predicted, "measured_over_predicted": versus_plan(measured, predicted)}
    except AtollError as e:  # a deployment the analytic model does not cost (replicas of dp, xPyD)
        out["predicted_error"] = str(e)
    factor = (speed or {}).get("factor")
    out["simulated"] = simulated(args, model_dir, config, requests, slos=slos, percentiles=percentiles, spec=spec,
                                 speed=factor)
    out["measured_over_simulated"] = versus_sim(measured, out["simulated"]["serve"])
    if speed is not None:
        out["speed"] = speed
    if factor is not None:  # the calibration as it is, beside
        plain = simulated(args, model_dir, config, requests, slos=slos, percentiles=percentiles, spec=spec)
        out["measured_over_simulated_uncorrected"] = versus_sim(measured, plain["serve"])
    return out


def simulated(args, model_dir: str, config, requests, *, slos: dict, percentiles, spec: dict | None = None,
              speed: float | None = None) -> dict:
    """The simulator's run of the same requests, arrivals and engine flags (planner/sim); speed:
    the calibration's measured steps times this."""
    topology = load_topology(args.topology)
    if speed is not None:
        topology = scaled_topology(topology, Path(model_dir).name, speed)
    deployment = from_engine_flags(args, config, topology, acceptance=spec["acceptance"] if spec else None,
                                   draft_rate=spec["draft_rate"] if spec else 1.0)
    return simulate(config, topology, deployment, tokenized(requests, model_dir), rate=args.request_rate,
                    burstiness=args.burstiness, max_concurrency=args.max_concurrency, seed=args.seed, slos=slos,
                    percentiles=percentiles, model_name=Path(model_dir).name)


SIM_FIGURES = (("ttft_p50", "ttft_ms", "p50"), ("tpot_p50", "tpot_ms", "p50"), ("tpot_p90", "tpot_ms", "p90"),
               ("ttft_mean", "ttft_ms", "mean"), ("tpot_mean", "tpot_ms", "mean"), ("itl_p50", "itl_ms", "p50"),
               ("e2el_p50", "e2el_ms", "p50"))


def versus_sim(measured: dict, sim: dict) -> dict:
    """Measured over simulated, figure by figure (goodput where SLOs were given)."""
    def ratio(m, p):
        return sig(m / p, 4) if m is not None and p else None

    out = {name: ratio(measured[group].get(key), sim[group].get(key)) for name, group, key in SIM_FIGURES}
    out["output_throughput"] = ratio(measured["output_throughput"], sim["output_throughput"])
    if "goodput" in measured and "goodput" in sim:
        out["goodput"] = ratio(measured["goodput"]["request_goodput"], sim["goodput"]["request_goodput"])
    return out


def plan_lines(plan: dict) -> list[str]:
    """--compare-plan's lines: the analytic prediction, the simulation, and measured over each."""
    lines = []
    if "predicted" in plan:
        p, x = plan["predicted"], plan["measured_over_predicted"]
        lines.append(f"  planner ({p['layout']} on {p['topology']}, {plan['costed_as']}): "
                     f"TTFT {num(p['ttft_ms'])} ms, TPOT {num(p['tpot_ms'])} ms, "
                     f"{num(p['output_tokens_per_s'])} output tok/s"
                     + ("" if p["sustainable"] else f" (not sustainable: {p['overload']})"))
        lines.append(f"  measured / predicted: TTFT {x['ttft']}, TPOT {x['tpot']}, "
                     f"output tok/s {x['output_throughput']}")
    else:
        lines.append(f"  planner: {plan['predicted_error']}")
    sim, x = plan["simulated"], plan["measured_over_simulated"]
    lines.append(f"  simulated ({sim['deployment']} on {sim['topology']}, steps from {sim['steps_from']}):")
    lines += ["  " + line for line in report_lines(sim["serve"])]
    if "speed" in plan:
        sp = plan["speed"]
        lines.append(f"  machine speed (measured tick / calibrated tick, median): probe {num(sp['factor'])} over "
                     f"{sp['probe_ticks']} ticks, the round {num(sp['during_run'])}")
    lines.append("  measured / simulated: " + ", ".join(f"{k} {v}" for k, v in x.items()))
    if "measured_over_simulated_uncorrected" in plan:
        lines.append("  measured / simulated with the calibration as it is: "
                     + ", ".join(f"{k} {v}" for k, v in plan["measured_over_simulated_uncorrected"].items()))
    return lines
