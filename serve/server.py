"""The app run by uvicorn on a socket already bound, with atoll's own signal handling:
SIGTERM/SIGINT drain (uvicorn stops accepting and waits for open responses; what is still
running at --shutdown-timeout ends with an error), and a dead engine ends the server after
/health has said 503 for a moment. uvicorn's own handlers would re-raise the signal at exit,
turning a clean drain into exit code 143."""

from __future__ import annotations

import asyncio
import contextlib
import signal
import sys

import uvicorn

from atoll.engine.driver.online import EngineDead
from atoll.serve.admin import EngineAdmin
from atoll.serve.admin_disagg import DisaggAdmin
from atoll.serve.app import create_app
from atoll.serve.backend import Backend
from atoll.serve.replicas import Replicas
from atoll.serve.scaler import ReplicasTarget, Scaler
from atoll.serve.scaler_disagg import DisaggTarget

WATCH_S = 0.2  # how often the engine's health is looked at


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        yield  # serve() installs atoll's handlers on the loop instead


async def serve(llm, sock, *, served_names: list[str], api_key: str | None, max_waiting: int | None,
                shutdown_timeout: float, log_level: str = "warning", dead_linger_s: float = 2.0,
                engine=None, tool_call_parser: str | None = None, admin_api: bool = False,
                autoscale: tuple | None = None, predictor=None) -> int:
    """Serve until a signal (returns 0 once drained) or the engine's death (raises EngineDead
    with the line naming the rank). engine: what serves the requests (serve.replicas.Replicas
    for several replicas; default llm's living engine). predictor: serve.predict.Predictor, the
    engines' predicted steps for --autoscale and /admin/engines."""
    engine = engine or llm.start()
    backend = Backend(llm, engine, max_waiting=max_waiting)
    if hasattr(engine, "attach_metrics"):  # replicas: the router's counters
        engine.attach_metrics(backend.metrics.registry)
    admin, scaler = _elastic(llm, engine, backend, admin_api, autoscale, predictor)
    app = create_app(backend, served_names=served_names, api_key=api_key, tool_call_parser=tool_call_parser,
                     admin=admin)
    # uvicorn's own graceful timeout is the backstop: by then every response has ended
    config = uvicorn.Config(app, log_level=log_level, access_log=log_level in ("info", "debug"), lifespan="off",
                            timeout_graceful_shutdown=shutdown_timeout + 5)
    server = _Server(config)
    loop = asyncio.get_running_loop()
    state: dict = {"dead": None}

    def drain(sig: signal.Signals) -> None:
        if backend.draining is not None:  # a second signal: stop now
            server.force_exit = True
            return
        n = sum(len(c.open) for c in backend.calls)
        print(f"atoll: {sig.name}: draining ({n} requests in flight, up to {shutdown_timeout:g} s)",
              file=sys.stderr, flush=True)
        backend.draining = "the server is shutting down"
        server.should_exit = True
        loop.call_later(shutdown_timeout, backend.fail_all,
                        f"the server shut down before this request finished (--shutdown-timeout {shutdown_timeout:g})")

    async def watch() -> None:
        while engine.error is None:
            await asyncio.sleep(WATCH_S)
        state["dead"] = engine.error
        await asyncio.sleep(dead_linger_s)  # /health answers 503 meanwhile
        server.should_exit = True

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, drain, sig)
    watcher = asyncio.create_task(watch())
    scaling = asyncio.create_task(scaler.run()) if scaler is not None else None
    try:
        await server.serve(sockets=[sock])
    finally:
        watcher.cancel()
        if scaling is not None:
            scaling.cancel()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    if state["dead"] is not None:
        raise EngineDead(f"the engine stopped: {state['dead']}")
    print("atoll: shut down", file=sys.stderr, flush=True)
    return 0


def _elastic(llm, engine, backend, admin_api: bool, autoscale: tuple | None, predictor=None):
    """The admin API's EngineAdmin (--enable-admin-api or --autoscale over replicas) and the
    Scaler (--autoscale: (Goodput, Policy, every_s)); None for what is off."""
    if not admin_api and autoscale is None:
        return None, None
    if llm.prefill_layout is not None:  # a disaggregated engine: serve.admin_disagg; --autoscale its threshold
        log = lambda line: print(f"atoll: {line}", file=sys.stderr, flush=True)  # noqa: E731
        # a healing job (serve.replica_start.start_disagg) is a set of one: its live engine
        current = (lambda: engine.engines[0]) if isinstance(engine, Replicas) else (lambda: engine)
        if autoscale is None:
            return DisaggAdmin(current, api=True), None
        admin = DisaggAdmin(current, api=admin_api)  # without --enable-admin-api: GET /admin/autoscale only
        goodput, policy, every_s = autoscale
        scaler = Scaler(DisaggTarget(current, log), backend.metrics, goodput, policy, every_s=every_s,
                        predictor=predictor)
        admin.scaler = scaler
        return admin, scaler
    admin = EngineAdmin(engine, layout=str(llm.layout), api=admin_api)
    admin.predictor = predictor
    if autoscale is not None:
        goodput, policy, every_s = autoscale
        admin.scaler = Scaler(ReplicasTarget(admin), backend.metrics, goodput, policy, every_s=every_s,
                              predictor=predictor)
    return admin, admin.scaler
