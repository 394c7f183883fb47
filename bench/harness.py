"""What every benchmark shares: the model it runs by default, the machine's load around the
run (a figure means little under load: it is recorded beside every result, and a warning
names a run that shared the machine), and printing a result as JSON or as a table.

    with Run(args.model, quiet=args.json) as run:   # run.model: the checkpoint dir to bench
        result = ...                                # timed side by side, as ratios
        run.note()                                  # the load after a round
    run.emit(result, as_json=args.json, render=render)
"""

from __future__ import annotations

import json
import os
import sys

from atoll.models.gguf import demo_model_dir


def default_model(model: str | None, *, quiet: bool = False) -> str:
    """`model`, or the demo model (SmolLM2-135M, converted once from its GGUF package)."""
    if model is not None:
        return str(model)

    return str(demo_model_dir(progress=not quiet))


def load_avg() -> float:
    return os.getloadavg()[0]


class Run:
    """One benchmark run: its model, and the 1-minute load average at its start, after each
    round (note) and at its end."""

    def __init__(self, model: str | None = None, *, quiet: bool = False, needs_model: bool = True):
        self.model = default_model(model, quiet=quiet) if needs_model else model
        self.cores = os.cpu_count() or 1
        self.loads = [load_avg()]

    def __enter__(self) -> "Run":
        return self

    def __exit__(self, *exc) -> None:
        self.note()

    def note(self) -> None:
        self.loads.append(load_avg())

    def record(self, result: dict, *, more_loads=()) -> dict:
        """result plus the load figures, and a warning when the load passed the core count
        after the start (the figure at the start mostly tells what ran before); more_loads:
        loads read elsewhere during the run (by a rank after each round)."""
        result = {**result, "cores": self.cores, "load_avg_1m": [round(x, 2) for x in self.loads]}
        peak = max([*self.loads[1:], *more_loads], default=self.loads[0])
        if peak > self.cores:
            result["load_warning"] = (f"the 1-minute load average reached {peak:.1f} on {self.cores} cores during "
                                      "the run: other work shared the machine, so these figures understate both sides")
        return result

    def emit(self, result: dict, *, as_json: bool, render, more_loads=(), indent: int | None = 2) -> dict:
        """Print the result (with the load recorded) as one JSON object or through render."""
        result = self.record(result, more_loads=more_loads)
        if "load_warning" in result:
            print(f"atoll bench: warning: {result['load_warning']}", file=sys.stderr, flush=True)
        if as_json:
            print(json.dumps(result, indent=indent))
        else:
            text = render(result)
            if text is not None:
                print(text)
        return result


def sig(x: float, digits: int = 5) -> float:
    """x to `digits` significant figures, for reports."""
    return float(f"{x:.{digits}g}")
