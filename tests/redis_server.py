"""A throwaway redis-server for the tests of the shared KV tier: the real one from the system's
packages, on a free port of 127.0.0.1, killed by its pid when the test ends."""

import shutil
import socket
import subprocess
import time

import pytest

SERVER = shutil.which("redis-server")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def server():
    """A throwaway redis-server on 127.0.0.1: (url, process)."""
    if SERVER is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server)")
    redis = pytest.importorskip("redis", reason="the redis package (pip install 'atoll[kv]')")
    port = free_port()
    proc = subprocess.Popen([SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    client = redis.Redis(port=port, socket_connect_timeout=0.2)
    deadline = time.monotonic() + 10
    while True:
        try:
            client.ping()
            break
        except redis.ConnectionError:
            if proc.poll() is not None or time.monotonic() > deadline:
                proc.kill()
                pytest.fail(f"redis-server on port {port} did not start")
            time.sleep(0.05)
    client.close()
    yield f"redis://127.0.0.1:{port}/0", proc
    proc.kill()
    proc.wait(timeout=10)
