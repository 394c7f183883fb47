"""The package's layers hold: the import-linter contracts in pyproject.toml (cli > tools >
launch > runtime > config; engine's sub-packages driver > ... > batch > kv; a scheduling half
and a planner without torch; imports inside functions included), and no circle of imports
between files. Each check is shown to bite on a copy of the package with the fault added."""

import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parent.parent


def file_cycles(graph) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan), each a circle of imports.
    A package's __init__ re-exporting its own modules is not a file circle with them."""
    modules = sorted(graph.modules)
    index, low, on, stack, out, counter = {}, {}, set(), [], [], [0]

    def edges(m):
        return [t for t in graph.find_modules_directly_imported_by(m)
                if t in graph.modules and not m.startswith(t + ".") and not t.startswith(m + ".")]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges(v):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                out.append(sorted(group))

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    for m in modules:
        if m not in index:
            visit(m)
    return out


def lint(root: Path, pythonpath: Path | None = None) -> subprocess.CompletedProcess:
    """import-linter on the contract in root/pyproject.toml, in a fresh interpreter."""
    code = ("import sys; from importlinter.cli import lint_imports; "
            f"sys.exit(lint_imports(config_filename={str(root / 'pyproject.toml')!r}, no_cache=True, no_logo=True))")
    env = None
    if pythonpath is not None:
        import os

        env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                          timeout=120, env=env)


def test_import_contract_holds():
    r = lint(ROOT)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "4 kept, 0 broken" in r.stdout


def test_no_file_imports_another_in_a_circle():
    graph = grimp.build_graph("atoll", cache_dir=None)
    assert len(graph.modules) > 100  # the whole package was read
    assert file_cycles(graph) == []


def test_cycle_check_bites():
    """A two-file circle added to the real graph is found."""
    graph = grimp.build_graph("atoll", cache_dir=None)
    graph.add_import(importer="atoll.engine.sample.sampler", imported="atoll.engine.driver.llm")
    assert any({"atoll.engine.driver.llm", "atoll.engine.sample.sampler"} <= set(c) for c in file_cycles(graph))


@pytest.mark.parametrize("upward", [
    "engine/sample/sampler.py:from atoll.launch import local",
    "layers/norm.py:    from atoll.engine.driver import llm  # inside a function",
    "engine/batch/scheduler.py:from atoll.engine.rank import core",  # upward inside engine, at the top
    "engine/kv/blocks.py:    from atoll.engine.driver import online  # inside a function",
    "engine/batch/lanes.py:import torch",  # torch in the scheduling half
    "engine/kv/windowed.py:    import torch  # inside a function",
    "engine/disagg/decision.py:from atoll.launch import local",  # a launcher in the disaggregation decision
    "planner/search.py:    import torch  # inside a function",
])
def test_contract_fails_on_an_added_upward_import(tmp_path, upward):
    """The real contract, run on a copy of the package with one upward import added."""
    import shutil

    copy = tmp_path / "atoll"
    shutil.copytree(ROOT, copy, ignore=shutil.ignore_patterns(".git", "tests", "examples", "__pycache__",
                                                              "*.egg-info"))
    path, line = upward.split(":", 1)
    target = copy / path
    text = target.read_text()
    if line.startswith("    "):
        line = "\n\ndef _upward():\n" + line + "\n"
    target.write_text(text + "\n" + line + "\n")
    r = lint(copy, pythonpath=tmp_path)
    assert r.returncode != 0, r.stdout[-2000:]
    assert "BROKEN" in r.stdout
    importer = "atoll." + path.removesuffix(".py").replace("/", ".")
    assert importer in r.stdout  # the report names the upward import
