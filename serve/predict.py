"""The planner's step costs for a running server, with live correction factors (--autoscale and
/admin/engines).

Each engine's step is predicted by the same function the simulator times its ticks with
(planner.sim.clock.StepCost: the cost model for the engine's layout, the model and the topology,
or the topology's measured steps of the model where `atoll calibrate --steps` wrote them). The
engines' first ranks append every tick's shape and seconds to a step trace (--step-trace; the
server makes its own files where none is given, one per replica); each look reads the new ticks
and sets each engine's correction factor: the median of measured / predicted seconds over its
last WINDOW ticks (serve.autoscale.Correction), and the same over its ticks with prompt chunks
(which correct the queue's wait) and its decode-only ticks (which correct TPOT) apart. The autoscaler's estimates are the planner's
predicted seconds for the load it sees now, times that factor:

    queue wait   the prompt tokens waiting (requests waiting x their mean prompt length) per
                 prefill engine (replica), prefilled in chunks of the chunk budget beside the
                 running rows, each chunk one predicted tick
    TPOT         one predicted decode tick of the running rows per decode engine (replica) at
                 their mean context, a chunk of the waiting prompts beside them on a colocated one

each also with one engine more (the queue) or fewer (TPOT), which says before the SLOs fail what
adding (or draining) an engine would do.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import threading
from argparse import Namespace
from collections import deque
from dataclasses import dataclass

from atoll.errors import AtollError
from atoll.models.presets import resolve_model
from atoll.planner.sim.deploy import engine_kind, from_engine_flags
from atoll.serve.autoscale import Correction
from atoll.topologies import load_topology

WINDOW = 64  # ticks a correction factor is the median over
KEEP_BYTES = 4 << 20  # a step trace the server made is emptied once read past this size


@dataclass
class Source:
    """A step trace file: `engine` names every tick in it (a replica's own file), else each
    line's own engine name counts; `own`: the server made it (it may empty it once read)."""
    path: str
    engine: str | None = None
    own: bool = False
    offset: int = 0


class EngineSteps:
    """One engine's ticks: predicted by its StepCost, measured, and their correction factor."""

    def __init__(self, cost, window: int = WINDOW):
        self.cost, self.correction = cost, Correction(window)
        # the same ratios apart for ticks with prompt chunks and decode-only ticks: the cost model
        # may miss the two by different factors (the queue is corrected by the first, TPOT by the second)
        self.chunked, self.decoding = Correction(window), Correction(window)
        self.pairs: deque[tuple[float, float]] = deque(maxlen=window)  # (predicted, measured) seconds
        self.contexts: deque[float] = deque(maxlen=window)  # decoding rows' mean context, per tick
        self.ticks = 0

    def predict(self, rows: float, chunk: float, ctx_sum: float, attended_sum: float,
                padded: float | None = None) -> tuple[float, float]:
        """(pass seconds, slowest stage seconds: one tick) of a step of this shape."""
        p, stage, _ = self.cost.tick(rows, chunk, ctx_sum, attended_sum, ctx_padded=padded)
        return p, stage

    def observe(self, rows: int, chunk: int, ctx_sum: float, attended_sum: float, seconds: float,
                padded: float | None = None) -> None:
        if not rows and not chunk:
            return
        predicted = self.predict(rows, chunk, ctx_sum, attended_sum, padded)[1]
        self.correction.observe(predicted, seconds)
        (self.chunked if chunk else self.decoding).observe(predicted, seconds)
        self.pairs.append((predicted, seconds))
        self.ticks += 1
        if rows:
            self.contexts.append(ctx_sum / rows)

    def view(self, name: str) -> dict:
        """Its predicted and measured step (medians over the window) and correction, and one line."""
        if not self.pairs:
            return {"predicted_step_ms": None, "measured_step_ms": None, "correction": 1.0, "ticks": 0,
                    "line": f"{name}: no step measured yet (correction 1.00)"}
        predicted = statistics.median(p for p, _ in self.pairs) * 1000
        measured = statistics.median(m for _, m in self.pairs) * 1000
        factor = self.correction.factor
        apart = {kind: round(getattr(self, kind).factor, 4) if getattr(self, kind).ratios else None
                 for kind in ("chunked", "decoding")}
        told = ", ".join(f"{what} {apart[kind]:.2f}" for kind, what in (("chunked", "prompt-chunk ticks"),
                                                                      ("decoding", "decode ticks"))
                         if apart[kind] is not None)
        return {"predicted_step_ms": round(predicted, 3), "measured_step_ms": round(measured, 3),
                "correction": round(factor, 4), "correction_chunked": apart["chunked"],
                "correction_decoding": apart["decoding"], "ticks": self.ticks,
                "line": f"{name}: predicted step {predicted:.2f} ms x correction {factor:.2f} = "
                        f"{predicted * factor:.2f} ms (measured {measured:.2f} ms, median of the last "
                        f"{len(self.pairs)} of {self.ticks} ticks; {told})"}


class Predictor:
    def __init__(self, costs: dict, sources: list[Source], *, budget: int, window: int = WINDOW):
        """costs: role ("prefill", "decode"; a colocated server's one under "decode") -> StepCost;
        budget: the chunk budget (tokens a tick prefills at most)."""
        self.costs, self.sources, self.budget, self.window = costs, sources, max(1, budget), window
        self.engines: dict[str, EngineSteps] = {}
        self._lock = threading.Lock()
        for src in sources:  # a replica's own trace: listed before its first tick
            if src.engine is not None:
                self.steps(src.engine)

    def role(self, name: str) -> str:
        return "prefill" if name.startswith("prefill") and "prefill" in self.costs else "decode"

    def steps(self, name: str) -> EngineSteps:
        if name not in self.engines:
            self.engines[name] = EngineSteps(self.costs[self.role(name)], self.window)
        return self.engines[name]

    def poll(self) -> None:
        """Read the ticks written since the last look."""
        with self._lock:
            for src in self.sources:
                self._read(src)

    def _read(self, src: Source) -> None:
        try:
            size = os.path.getsize(src.path)
        except OSError:
            return  # not written yet
        if size < src.offset:  # emptied meanwhile
            src.offset = 0
        with open(src.path, "rb") as f:
            f.seek(src.offset)
            data = f.read(size - src.offset)
        end = data.rfind(b"\n") + 1  # a line still being written is read next time
        src.offset += end
        for line in data[:end].decode("utf-8", "replace").splitlines():
            try:
                d = json.loads(line)
                self.steps(src.engine or d["engine"]).observe(
                    d["rows"], d["chunk_tokens"], d["ctx_sum"], d["attended_sum"], d["seconds"],
                    d.get("ctx_padded", d["ctx_sum"]))
            except (ValueError, KeyError, TypeError):
                continue  # a torn line after an emptying
        if src.own and src.offset > KEEP_BYTES:
            os.truncate(src.path, 0)  # the ranks append (O_APPEND): their next line starts the file again
            src.offset = 0

    def view(self) -> dict[str, dict]:
        """Every engine seen: its predicted step, measured step and correction factor."""
        self.poll()
        with self._lock:
            return {name: steps.view(name) for name, steps in sorted(self.engines.items())}

    def factor(self, role: str, kind: str | None = None) -> float:
        """The role's correction: the median ratio over its engines' windows (1.0 before any tick);
        kind "chunked" or "decoding": over those ticks only, where there are any."""
        mine = [s for name, s in self.engines.items() if self.role(name) == role]
        ratios = [r for s in mine for r in getattr(s, kind).ratios] if kind else []
        ratios = ratios or [r for s in mine for r in s.correction.ratios]
        return statistics.median(ratios) if ratios else 1.0

    def _context(self, role: str, default: float) -> float:
        seen = [c for name, s in self.engines.items() if self.role(name) == role for c in s.contexts]
        return statistics.fmean(seen) if seen else default

    def estimate(self, fleet, *, waiting: float, running: float, prompt: float) -> dict:
        """serve.autoscale.Sample's estimates (queue_s, tpot_s, queue_more_s, tpot_less_s,
        correction) for the load now on `fleet` (serve.autoscale.Fleet)."""
        self.poll()
        with self._lock:
            colocated = fleet.prefill + fleet.decode == 0
            n_prefill = fleet.replicas if colocated else fleet.prefill
            n_decode = fleet.replicas if colocated else fleet.decode
            f_prefill = self.factor("prefill" if "prefill" in self.costs else "decode", "chunked")
            f_decode = self.factor("decode", "decoding")
            context = self._context("decode", prompt)
            out = {"correction": f_prefill, "tpot_correction": f_decode}
            if n_prefill >= 1:
                out["queue_s"] = self._queue(n_prefill, waiting, running / n_prefill if colocated else 0, prompt,
                                             context) * f_prefill
                out["queue_more_s"] = self._queue(n_prefill + 1, waiting, running / (n_prefill + 1) if colocated
                                                  else 0, prompt, context) * f_prefill
            if n_decode >= 1 and running > 0:
                beside = waiting * prompt / n_decode if colocated else 0.0
                out["tpot_s"] = self._tpot(running / n_decode, beside, prompt, context) * f_decode
                if n_decode > 1:
                    beside = waiting * prompt / (n_decode - 1) if colocated else 0.0
                    out["tpot_less_s"] = self._tpot(running / (n_decode - 1), beside, prompt, context) * f_decode
            return out

    def _queue(self, engines: int, waiting: float, rows: float, prompt: float, context: float) -> float:
        """Predicted seconds to prefill what waits, per engine, in chunks of the budget."""
        tokens = waiting * prompt / engines
        if tokens <= 0:
            return 0.0
        chunk, rows = min(self.budget, tokens), math.ceil(rows)
        cost = self.costs["prefill" if "prefill" in self.costs else "decode"]
        return math.ceil(tokens / self.budget) * cost.tick(rows, chunk, rows * context, chunk * prompt / 2)[0]

    def _tpot(self, rows: float, beside: float, prompt: float, context: float) -> float:
        rows, chunk = max(1, math.ceil(rows)), min(self.budget, beside)
        return self.costs["decode"].tick(rows, chunk, rows * context, chunk * prompt / 2)[0]


def for_server(args, llm, sources: list[Source], *, replicas: int, log) -> Predictor | None:
    """The running server's Predictor: its engines' layouts on --topology (the calibrated one where
    given, else the preset; default local), from the engine flags; None (and one line to log)
    when the planner cannot cost this model or layout."""

    try:
        topology = load_topology(getattr(args, "topology", None) or "local")
        name, config = resolve_model(str(llm.model_dir))
        flags = Namespace(**vars(args))
        flags.layout, flags.data_parallel_size = str(llm.layout), None
        flags.tensor_parallel_size = flags.pipeline_parallel_size = None
        flags.expert_parallel_size = flags.context_parallel_size = None
        d = from_engine_flags(flags, config, topology, acceptance=0.0)
        if d.disaggregated:
            layouts = {"prefill": d.prefill, "decode": d.decode}
            ranks = d.prefill_replicas * llm.prefill_layout.world_size + d.decode_replicas * llm.layout.world_size
        else:
            layouts, ranks = {"decode": d.layout}, replicas * llm.layout.world_size
        kinds = {role: engine_kind(config, topology, d, lay, isl=512, osl=128, ranks=ranks, model_name=name)
                 for role, lay in layouts.items()}
    except (AtollError, ValueError, OSError) as e:
        log(f"no step predictions for --autoscale and /admin/engines: {e}")
        return None
    return Predictor({role: k.step_cost() for role, k in kinds.items()}, sources,
                     budget=kinds["decode"].max_num_batched_tokens)
