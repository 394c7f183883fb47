"""The server `atoll bench serve` starts itself when no --url is given: `python -m atoll serve`
on a free 127.0.0.1 port with the engine flags the bench was given, its output in a log
file, ready once /health answers 200 (bounded), and ended by its pid (SIGTERM, then SIGKILL
to its process group, its ranks included, when it does not exit in time)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import fields

import psutil

from atoll.config import resolve
from atoll.config.engine import EngineConfig
from atoll.errors import LaunchError

# the model options of cli/generate.add_model_options that are not EngineConfig fields
LAYOUT_FLAGS = (("--layout", "layout"), ("--tensor-parallel-size", "tensor_parallel_size"),
                ("--pipeline-parallel-size", "pipeline_parallel_size"),
                ("--data-parallel-size", "data_parallel_size"), ("--expert-parallel-size", "expert_parallel_size"),
                ("--context-parallel-size", "context_parallel_size"))


def engine_argv(args, **override) -> list[str]:
    """The engine flags the bench was given (those set away from their default) as `atoll serve`
    takes them, with `override` (field name -> value) on top."""
    argv = []
    for flag, dest in LAYOUT_FLAGS:
        if getattr(args, dest, None) is not None:
            argv += [flag, str(getattr(args, dest))]
    defaults = resolve()
    for f in fields(EngineConfig):
        if f.metadata.get("cli") is False or not hasattr(args, f.name):
            continue
        value = override.get(f.name, getattr(args, f.name))
        if value == getattr(defaults, f.name) and f.name not in override:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(value, bool):
            argv.append(flag if value else "--no-" + flag[2:])
        elif value is not None:
            argv += [flag, str(value)]
    return argv


def cpu_seconds(pid: int, *, children: bool) -> float:
    """User + system CPU seconds of a live process (its threads included), or of its
    descendants; processes gone by now count 0."""
    try:
        procs = psutil.Process(pid).children(recursive=True) if children else [psutil.Process(pid)]
    except psutil.NoSuchProcess:
        return 0.0
    total = 0.0
    for p in procs:
        try:
            t = p.cpu_times()
            total += t.user + t.system
        except psutil.NoSuchProcess:
            pass
    return total


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """`with Server(model, argv) as url:` a started `atoll serve`, ended at the block's end."""

    def __init__(self, model: str, argv: list[str], *, ready_timeout_s: float = 300.0, stop_timeout_s: float = 30.0):
        self.model, self.argv = model, list(argv)
        self.ready_timeout_s, self.stop_timeout_s = ready_timeout_s, stop_timeout_s
        self.proc: subprocess.Popen | None = None
        self.log = None
        self.url = ""
        self.started_s = 0.0  # seconds from the start to /health answering

    def __enter__(self) -> str:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    @property
    def command(self) -> list[str]:
        return [sys.executable, "-m", "atoll", "serve", "--model", self.model, *self.argv]

    def start(self) -> str:
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.log = tempfile.NamedTemporaryFile("w+", prefix="atoll-bench-serve-", suffix=".log", delete=False)
        t0 = time.monotonic()
        self.proc = subprocess.Popen([*self.command, "--host", "127.0.0.1", "--port", str(port)],
                                     stdout=self.log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                     start_new_session=True)  # its ranks share its process group
        try:
            self._wait_ready()
        except BaseException:
            self.stop()
            raise
        self.started_s = time.monotonic() - t0
        return self.url

    def _wait_ready(self) -> None:
        # lazy: httpx is the optional atoll[serve]; atoll simulate imports this module without it
        import httpx

        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise LaunchError(f"atoll serve exited with code {self.proc.returncode} before it was ready: "
                                  f"{self.tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise LaunchError(f"atoll serve did not answer {self.url}/health within {self.ready_timeout_s:.0f} s: "
                          f"{self.tail()}")

    def cpu(self) -> dict:
        """CPU seconds so far of the server's own process (HTTP, streaming, the engine's driver)
        and of its ranks."""
        if self.proc is None:
            return {}
        return {"server": cpu_seconds(self.proc.pid, children=False),
                "ranks": cpu_seconds(self.proc.pid, children=True)}

    def tail(self, lines: int = 8) -> str:
        """The last lines of the server's output, as one line."""
        if self.log is None:
            return ""
        self.log.flush()
        with open(self.log.name, encoding="utf-8", errors="replace") as f:
            text = f.read().strip().splitlines()[-lines:]
        return " | ".join(text) or "(no output)"

    def stop(self) -> None:
        """SIGTERM to the server's pid; past stop_timeout_s, SIGKILL to its process group."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(self.stop_timeout_s)
            except subprocess.TimeoutExpired:
                try:
                    os.killpg(proc.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                proc.wait(10)
        if proc is not None:  # ranks that outlived their server (killed hard) go with its group
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
        if self.log is not None:
            self.log.close()
            os.unlink(self.log.name)
            self.log = None
