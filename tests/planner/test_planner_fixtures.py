"""The planner's output held still: every field of the table, the JSON and the saved plan for
3 models x 3 topologies x 3 workloads, recorded from the planner before issue 29 made it fast,
compared field by field.

Strings (the table's text, reasons, names, the saved plan's summary) must match exactly: they
carry every number at the precision the CLI prints it. Floats of the JSON and the saved plan
(printed in full) must match to a relative 1e-9 (absolute 1e-12 about zero): the same
arithmetic in another order may differ in the last bits, nothing more.

Record again (only when a change of the predictions is meant, and say so in the commit):
    python tests/planner/test_planner_fixtures.py --record
"""

from __future__ import annotations

import io
import json
import math
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' root, when run as a script
from paths import DATA, REPO  # noqa: E402

FIXTURES = DATA / "planner_fixtures"
MODELS = ("Llama-3.1-70B", "Qwen3-30B-A3B", "DeepSeek-V3")
TOPOLOGIES = (("dgx-h200", 2), ("dgx-h100", 2), ("l40s-pcie", None))
# closed loop at 1 and 256 requests in flight; open loop at a rate that some layouts sustain
# and some do not (per model: what its layouts serve on 16 Hopper GPUs differs tenfold)
RATES = {"Llama-3.1-70B": 20.0, "Qwen3-30B-A3B": 40.0, "DeepSeek-V3": 12.0}
REL, ABS = 1e-9, 1e-12


def workloads(model: str) -> list[dict]:
    return [dict(concurrency=1), dict(concurrency=256), dict(concurrency=128, request_rate=RATES[model])]


def fixture_path(model: str, topology: str) -> Path:
    return FIXTURES / f"{model}_{topology}.json"


def outputs(model: str, topology: str, nodes: int | None) -> list[dict]:
    """What `atoll plan` prints for each workload: the JSON (Plan.to_dict), the table's text and
    the saved plan (planfile.from_plan) with its one-line summary."""
    from rich.console import Console

    from atoll.models.presets import resolve_model
    from atoll.planner import Workload, plan_sweep
    from atoll.planner.planfile import from_plan
    from atoll.planner.table import print_plans
    from atoll.topologies import load_topology

    topo = load_topology(topology, nodes=nodes)
    _, config = resolve_model(model)
    out = []
    # one sweep over the workloads, as `atoll plan --concurrency a,b,c` asks (the planner of
    # the recording planned each alone: the same numbers)
    plans = plan_sweep(model, topo, [Workload(**w) for w in workloads(model)])
    for w, plan in zip(workloads(model), plans):
        buf = io.StringIO()
        print_plans([plan], top=10, console=Console(file=buf, width=140, color_system=None, force_terminal=False))
        saved = from_plan(plan, config) if plan.recommended is not None else None
        out.append({"workload": w, "plan": plan.to_dict(), "table": buf.getvalue(),
                    "saved": saved.to_dict() if saved else None, "summary": saved.summary() if saved else None})
    return out


def _diff(want, got, where: str) -> list[str]:
    """Every place `got` differs from `want`: floats beyond REL/ABS, anything else unequal."""
    if isinstance(want, float) or isinstance(got, float):
        if isinstance(want, (int, float)) and isinstance(got, (int, float)) and not isinstance(want, bool):
            if want == got or math.isclose(want, got, rel_tol=REL, abs_tol=ABS):
                return []
        return [f"{where}: {want!r} -> {got!r}"]
    if isinstance(want, dict) and isinstance(got, dict):
        if list(want) != list(got):
            return [f"{where}: keys {list(want)} -> {list(got)}"]
        return [d for k in want for d in _diff(want[k], got[k], f"{where}.{k}")]
    if isinstance(want, list) and isinstance(got, list):
        if len(want) != len(got):
            return [f"{where}: {len(want)} items -> {len(got)}"]
        return [d for i, (a, b) in enumerate(zip(want, got)) for d in _diff(a, b, f"{where}[{i}]")]
    return [] if want == got else [f"{where}: {want!r} -> {got!r}"]


def _normal(x):
    """As json would give it back: tuples as lists, inf as inf."""
    return json.loads(json.dumps(x))


@pytest.mark.parametrize("topology,nodes", TOPOLOGIES, ids=[t for t, _ in TOPOLOGIES])
@pytest.mark.parametrize("model", MODELS)
def test_planner_output_unchanged(model, topology, nodes):
    want = json.loads(fixture_path(model, topology).read_text())["cases"]
    got = _normal(outputs(model, topology, nodes))
    assert len(got) == len(want)
    for w, g in zip(want, got):
        assert g["workload"] == w["workload"]
        where = f"{model} on {topology}, {w['workload']}"
        assert g["table"] == w["table"], f"{where}: the table changed"
        assert g["summary"] == w["summary"], f"{where}: the saved plan's summary changed"
        diffs = _diff(w["plan"], g["plan"], "plan") + _diff(w["saved"], g["saved"], "saved")
        assert not diffs, f"{where}: {len(diffs)} fields changed, e.g.\n" + "\n".join(diffs[:10])


def record() -> None:
    FIXTURES.mkdir(parents=True, exist_ok=True)
    for model in MODELS:
        for topology, nodes in TOPOLOGIES:
            cases = outputs(model, topology, nodes)
            path = fixture_path(model, topology)
            path.write_text(json.dumps({"model": model, "topology": topology, "nodes": nodes, "cases": cases},
                                       indent=None, separators=(",", ":")) + "\n")
            print(f"wrote {path.relative_to(REPO)}", file=sys.stderr)


if __name__ == "__main__":
    if sys.argv[1:] != ["--record"]:
        sys.exit(f"usage: python {Path(__file__).name} --record")
    record()
