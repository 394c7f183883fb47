"""`atoll serve`'s command line: its help imports neither the optional serve packages nor
transformers, and what a user gets wrong is one line and exit 2 before any rank starts."""

import socket
import subprocess
import sys

import pytest
from cli import run_cli

NO_HEAVY = """
import sys
from atoll.cli.main import main
try:
    main(["serve", "--help"])
except SystemExit as e:
    assert e.code == 0
heavy = sorted(m for m in ("fastapi", "uvicorn", "prometheus_client", "transformers") if m in sys.modules)
assert not heavy, heavy
"""


def test_serve_help_imports_no_server_packages():
    r = subprocess.run([sys.executable, "-c", NO_HEAVY], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr


@pytest.fixture
def no_ranks(monkeypatch):
    def start(*args, **kwargs):
        raise AssertionError("a rank was started")

    monkeypatch.setattr("atoll.engine.driver.llm.LLM.start", start)


@pytest.fixture
def taken_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(1)
        yield s.getsockname()[1]


@pytest.mark.parametrize("argv,error", [
    (["--port", "70000"], "--port 70000 must be between 0 and 65535"),
    (["--shutdown-timeout", "0"], "--shutdown-timeout 0 must be a positive number"),
    (["--max-waiting-requests", "0"], "--max-waiting-requests 0 must be at least 1"),
    (["--launcher", "torchrun"], "torchrun"),
    (["--prefill", "TP1", "--decode", "TP1", "--launcher", "torchrun"], "local or Ray launcher"),
    (["-tp", "3"], "tp=3"),
    (["--plan", "no-such-plan.yaml"], "no plan file at"),
    (["--plan", "no-such-plan.yaml", "-tp", "2"], "give --plan or -tp, not both"),
    (["-dp", "2", "--autoscale"], "--autoscale needs --goodput ttft:MS tpot:MS"),
    (["-dp", "2", "--goodput", "ttft:500", "tpot:50"], "--goodput is for --autoscale"),
    (["-dp", "2", "--topology", "local"], "--topology is for --autoscale and --enable-admin-api"),
    (["-dp", "2", "--enable-admin-api", "--topology", "no-such-topology.yaml"], "no topology file at"),
    (["--autoscale", "--goodput", "ttft:500", "tpot:50"], "--autoscale needs engines to add and drain"),
    (["-dp", "2", "--autoscale", "--goodput", "ttft:500"], "--goodput: tpot:MS is missing"),
    (["-dp", "2", "--autoscale", "--goodput", "ttft:500", "tpot:50", "--autoscale-interval-s", "0"],
     "--autoscale-interval-s 0 must be a positive number"),
    (["--enable-admin-api", "--restart-policy", "never"], "--enable-admin-api: one engine under --restart-policy never"),
])
def test_bad_flags_are_one_line(capsys, tiny_model, no_ranks, argv, error):
    code, _, err = run_cli(capsys, "serve", "--model", tiny_model("llama"), *argv)
    assert code == 2 and err.count("\n") == 1 and error in err and "Traceback" not in err, err


def test_a_port_in_use_is_one_line_before_any_rank(capsys, tiny_model, no_ranks, taken_port):
    code, _, err = run_cli(capsys, "serve", "--model", tiny_model("llama"), "--port", taken_port)
    assert code == 2 and f"cannot listen on 127.0.0.1:{taken_port}: Address already in use" in err, err
