"""--compare-plan's speed probe: how fast the machine runs the model's steps now, against the
calibration's fit of them.

A calibration (`atoll calibrate --steps`) fits the model's engine ticks on this machine at one
time; a shared or virtual machine's speed moves between then and a run (on this project's 2-core
machine the same command's TPOT moved 1.4x between runs). With the server started by the bench
and a measured fit in the topology, the bench starts the server with `--step-trace` and, after the
warm-up, sends a second warm-up of the same shape (new prompts, the steps already compiled): the
probe. Its ticks over the fit's time for each give the speed factor, the median ratio; the
simulation scales the fit by it, and the uncorrected simulation is kept beside it. The same ratio
over the measured round's own ticks is reported too (`during_run`), never fed to the simulator:
it says how far the machine's speed moved between the probe and the run.
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import tempfile
from pathlib import Path

from atoll.engine.rank.trace import read_ticks
from atoll.errors import AtollError
from atoll.planner.sim.api import prepare
from atoll.planner.sim.deploy import from_engine_flags
from atoll.planner.sim.load import tokenized
from atoll.planner.sim.stepfit import StepFit
from atoll.topologies import load_topology

PROBE_SEED = 2_000_003  # the probe's prompts: none of a round's or the warm-up's
MIN_TICKS = 8  # fewer measured ticks than this give no factor


class Probe:
    """The probe of one bench run: `Probe.start(args, model_dir, config, requests)` (None when
    there is nothing to probe: no --compare-plan, a --url server, --no-speed-probe, or no measured
    fit for this model in the topology); `engine_flags` for the server; `measure(send)` after the
    warm-up, send() sending the probe's requests; `round_start()` and `round_end()` around
    the measured round; `report()`; `close()`."""

    def __init__(self, path: str, own: bool, fits: list):
        self.path, self.own, self.fits = path, own, fits
        self.factor: float | None = None
        self.ticks = 0
        self.during: float | None = None
        self._round_start = 0

    @classmethod
    def start(cls, args, model_dir: str, config, requests) -> "Probe | None":
        if not args.compare_plan or args.url or not getattr(args, "speed_probe", True):
            return None
        try:
            topology = load_topology(args.topology)
            cal = topology.calibration
            if cal is None or Path(model_dir).name not in cal.steps:
                return None
            # the fits do not depend on the acceptance the simulator is given
            deployment = from_engine_flags(args, config, topology, acceptance=1.0)
            kinds = prepare(config, topology, deployment, tokenized(requests, model_dir),
                            model_name=Path(model_dir).name).kinds
        except AtollError:
            return None  # --compare-plan reports the deployment's error itself
        fits = [k.fit for k in kinds]
        if not any(fits):
            return None
        own = args.step_trace is None
        if own:
            fd, path = tempfile.mkstemp(prefix="atoll-probe-", suffix=".jsonl")
            os.close(fd)
        return cls(path if own else args.step_trace, own, fits)

    @property
    def engine_flags(self) -> dict:
        return {"step_trace": self.path}

    def _mark(self) -> int:
        return os.path.getsize(self.path) if os.path.exists(self.path) else 0

    def _factor(self, start: int, end: int | None = None) -> tuple[float | None, int]:
        return speed_factor(read_ticks(self.path, start, end) if os.path.exists(self.path) else [], self.fits)

    def measure(self, send) -> None:
        start = self._mark()
        send()
        self.factor, self.ticks = self._factor(start)

    def round_start(self) -> None:
        self._round_start = self._mark()

    def round_end(self) -> None:
        self.during, _ = self._factor(self._round_start, self._mark())

    def report(self) -> dict:
        return {"factor": self.factor, "probe_ticks": self.ticks, "during_run": self.during}

    def close(self) -> None:
        if self.own and os.path.exists(self.path):
            os.unlink(self.path)


def fit_for(engine: str, fits: list[StepFit | None]) -> StepFit | None:
    """The fit an engine's ticks are timed by: a decode engine's is the second kind's under xPyD
    (prefill first, as planner.sim.api.prepare lists them), every other engine's the first's."""
    if len(fits) > 1 and engine.startswith("decode"):
        return fits[1]
    return fits[0]


def speed_factor(ticks: list, fits: list[StepFit | None]) -> tuple[float | None, int]:
    """(median of measured over fitted seconds over the ticks, how many ticks): None when fewer
    than MIN_TICKS have a fit."""
    ratios = []
    for engine, rows, chunk, ctx, attended, seconds, padded, graph in ticks:
        fit = fit_for(engine, fits)
        if fit is None or (not rows and not chunk):
            continue
        want = fit.seconds(rows, chunk, ctx, attended, padded, split=graph is False)
        if want > 0 and seconds > 0:
            ratios.append(seconds / want)
    if len(ratios) < MIN_TICKS:
        return None, len(ratios)
    return statistics.median(ratios), len(ratios)


def scaled_topology(topology, model_name: str, factor: float):
    """The topology with the model's measured steps (every layout's) scaled by factor."""
    cal = topology.calibration
    steps = dict(cal.steps)
    steps[model_name] = {key: scale(StepFit.from_dict(d, f"calibration.steps.{model_name}.{key}"), factor).to_dict()
                         for key, d in cal.steps.get(model_name, {}).items()}
    return dataclasses.replace(topology, calibration=dataclasses.replace(cal, steps=steps))


def scale(fit: StepFit, factor: float) -> StepFit:
    """The fit with every time term times factor."""
    return dataclasses.replace(
        fit, rows={k: v * factor for k, v in fit.rows.items()}, chunk_token_us=fit.chunk_token_us * factor,
        ctx_kilotoken_us=fit.ctx_kilotoken_us * factor, attended_kilotoken_us=fit.attended_kilotoken_us * factor,
        chunk_base_us=None if fit.chunk_base_us is None else fit.chunk_base_us * factor,
        chunk_row_us=fit.chunk_row_us * factor, chunk_ctx_kilotoken_us=fit.chunk_ctx_kilotoken_us * factor)
