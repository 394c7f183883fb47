"""The admin API (`--enable-admin-api`, off by default; behind `--api-key` when one is given):
the engines a replicas server holds, and the changes an operator (or serve.autoscale) makes to
them, within the ranks the server started with.

    GET  /admin/engines               every engine: id, role, layout, state, health, load, rank pids, and
                                      its step: predicted by the planner, measured, the correction
                                      factor, in one line (serve.predict)
    GET  /admin/autoscale             --autoscale's decisions, each with its reason (serve.scaler)
    POST /admin/engines/{id}/drain    no new requests go to it; those it runs finish there
    POST /admin/engines/{id}/remove   drained (up to timeout_s), then its ranks stopped: what still
                                      runs there continues on another engine with its tokens
    POST /admin/engines/{id}/role     {"role": "prefill" | "decode"}: a disaggregated server's engines
    POST /admin/engines               {"id": K} or {}: a drained engine serves again; a removed one's
                                      ranks start again on its resources

An engine's state: serving, draining (requests still running), drained, removing, removed,
starting, restarting (after a failure, serve.restarts) or dead. The last serving engine can be
neither drained nor removed. Every refusal is one line in OpenAI's error body, with 400 (bad
body), 404 (no such engine) or 409 (not in a state that allows it).
"""

from __future__ import annotations

import asyncio
import sys
import threading
import time

from fastapi import FastAPI, Request

from atoll.serve.protocol import ApiError

ROLES = ("prefill", "decode")
REMOVE_WAIT_S = 30.0  # how long `remove` waits for a draining engine's requests by default


class AdminError(ApiError):
    """A refused admin call: one line, not counted among the failed requests."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.counted = True


class EngineAdmin:
    """What the admin API does to a serve.replicas.Replicas (its `off` states)."""

    def __init__(self, replicas, *, layout: str, log=None, api: bool = True):
        """log(line): where each change is told (default: stderr); api: /admin/engines is served
        (--enable-admin-api; without it only --autoscale's GET /admin/autoscale is)."""
        self.replicas, self.layout, self.api = replicas, layout, api
        self.log = log or (lambda line: print(f"atoll: admin: {line}", file=sys.stderr, flush=True))
        self._lock = threading.Lock()  # one change at a time
        self.scaler = None  # serve.scaler.Scaler under --autoscale: its decisions at GET /admin/autoscale
        self.predictor = None  # serve.predict.Predictor: each engine's predicted step and correction

    def engine(self, k) -> int:
        """Engine id k checked: 404 for one the server does not hold."""
        count = len(self.replicas.engines)
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < count:
            raise AdminError(404, f"engine {k!r} does not exist: this server holds engines 0..{count - 1}",
                           param="id", code="engine_not_found")
        return k

    def state(self, k: int) -> str:
        state, unfinished = self.replicas.state(k)
        return "drained" if state == "draining" and unfinished == 0 else state

    def describe(self, k: int, steps: dict | None = None) -> dict:
        """steps: serve.predict.Predictor.view() (default: read now, where there is a predictor)."""
        if steps is None and self.predictor is not None:
            steps = self.predictor.view()
        state, unfinished = self.replicas.state(k)
        engine = self.replicas.engines[k]
        up = state in ("serving", "draining")
        stats = engine.stats if up else {}
        return {"id": k, "role": "replica", "layout": self.layout, "state": self.state(k),
                "health": "ok" if up else state,
                "load": {"running": stats.get("running", 0), "waiting": stats.get("waiting", 0),
                         "unfinished": unfinished},
                "kv": {"blocks_in_use": stats.get("blocks_in_use", 0), "blocks_total": stats.get("num_blocks", 0)},
                "pids": list(getattr(engine.job, "pids", [])) if up else [],
                "step": self._step(k, steps)}

    def _step(self, k: int, steps: dict | None) -> dict | None:
        """Engine k's predicted and measured step and correction factor (None without a predictor)."""
        if steps is None:
            return None
        name = f"replica {k}" if len(self.replicas.engines) > 1 else "engine"
        none = {"predicted_step_ms": None, "measured_step_ms": None, "correction": 1.0, "ticks": 0,
                "line": f"{name}: no step measured yet (correction 1.00)"}
        return steps.get(name) or steps.get("engine") or none

    def list(self) -> list[dict]:
        steps = self.predictor.view() if self.predictor is not None else None
        return [self.describe(k, steps) for k in range(len(self.replicas.engines))]

    def _serving(self) -> list[int]:
        return [k for k in range(len(self.replicas.engines)) if self.replicas.state(k)[0] == "serving"]

    def drain(self, k: int, *, why: str = "asked") -> dict:
        k = self.engine(k)
        with self._lock:
            state = self.state(k)
            if state in ("draining", "drained"):
                return self.describe(k)
            if state != "serving":
                raise AdminError(409, f"engine {k} is {state}: only a serving engine can be drained",
                               param="id", code="engine_state")
            if self._serving() == [k]:
                raise AdminError(409, f"engine {k} is the last one serving: add another before draining it",
                               param="id", code="engine_state")
            self.replicas.off[k] = "draining"
        self.log(f"engine {k} draining ({why})")
        return self.describe(k)

    def remove(self, k: int, *, timeout_s: float = REMOVE_WAIT_S, why: str = "asked") -> dict:
        """Drain engine k, wait up to timeout_s for its requests, then stop its ranks (the rest
        of its requests continue elsewhere with their tokens: serve.replicas' migration)."""
        k = self.engine(k)
        with self._lock:
            state = self.state(k)
            if state == "removed":
                return self.describe(k)
            if state not in ("serving", "draining", "drained"):
                raise AdminError(409, f"engine {k} is {state}: only a serving or drained engine can be removed",
                               param="id", code="engine_state")
            if state == "serving" and self._serving() == [k]:
                raise AdminError(409, f"engine {k} is the last one serving: add another before removing it",
                               param="id", code="engine_state")
            self.replicas.off[k] = "removing"
        deadline = time.monotonic() + timeout_s
        while self.replicas.state(k)[1] and time.monotonic() < deadline:
            time.sleep(0.05)
        left = self.replicas.state(k)[1]
        self.replicas.off[k] = "removed"  # before its close: not a failure to restart
        self.replicas.engines[k].close(timeout_s=10.0)
        self.log(f"engine {k} removed ({why}; {left} request(s) still running moved to another engine)")
        return self.describe(k)

    def add(self, k: int | None = None, *, why: str = "asked") -> dict:
        """Engine k (default: the first drained, else the first removed) serves again; a removed
        one's ranks are started on its resources first (this thread waits for them)."""
        with self._lock:
            free = [j for j in range(len(self.replicas.engines)) if self.state(j) in ("drained", "draining", "removed")]
            if k is None:
                if not free:
                    raise AdminError(409, f"no free engine slot: all {len(self.replicas.engines)} engines this server "
                                        "holds are in use", code="engine_state")
                k = min(free, key=lambda j: (self.state(j) == "removed", j))
            k = self.engine(k)
            if k not in free:
                raise AdminError(409, f"engine {k} is {self.state(k)}: only a drained or removed engine can be added",
                               param="id", code="engine_state")
            if self.state(k) != "removed":
                self.replicas.off.pop(k, None)
                self.log(f"engine {k} serving again ({why})")
                return self.describe(k)
            self.replicas.off[k] = "starting"
        try:
            self.replicas.bring_back(k)
        except Exception as e:  # noqa: BLE001 - the slot stays free; the caller hears why
            self.replicas.off[k] = "removed"
            raise AdminError(503, f"engine {k} did not start: {e}", param="id", code="engine_start") from None
        self.log(f"engine {k} started again and serving ({why})")
        return self.describe(k)

    def role(self, k: int, role) -> dict:
        k = self.engine(k)
        if role not in ROLES:
            raise AdminError(400, f"role={role!r}: choose one of {', '.join(ROLES)}", param="role")
        raise AdminError(409, f"engine {k} is a replica: roles apply to a disaggregated server's prefill and decode "
                            "engines (--prefill/--decode)", param="id", code="engine_role")


async def _body(request: Request) -> dict:
    raw = await request.body()
    if not raw.strip():
        return {}
    try:
        body = await request.json()
    except ValueError:
        raise AdminError(400, "the body is not JSON", param="body") from None
    if not isinstance(body, dict):
        raise AdminError(400, "the body must be a JSON object", param="body")
    return body


def _timeout(body: dict) -> float:
    t = body.get("timeout_s", REMOVE_WAIT_S)
    if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t <= 3600:
        raise AdminError(400, f"timeout_s={t!r} must be a number of seconds from 0 to 3600", param="timeout_s")
    return float(t)


def mount_admin(app: FastAPI, admin: EngineAdmin) -> None:
    """The /admin/engines routes on the app (its changes run in a thread: a start takes seconds)."""

    def engines_api():
        if not admin.api:
            raise AdminError(404, "the admin API is off: start the server with --enable-admin-api", code="admin_off")

    @app.get("/admin/engines")
    async def engines():
        engines_api()
        return {"object": "list", "data": await asyncio.to_thread(admin.list)}

    @app.get("/admin/autoscale")
    async def autoscale():
        if admin.scaler is None:
            raise AdminError(404, "autoscale is off: start the server with --autoscale", code="autoscale_off")
        return {"object": "list", "data": list(admin.scaler.decisions)}

    @app.post("/admin/engines/{k}/drain")
    async def drain(k: int):
        engines_api()
        return await asyncio.to_thread(admin.drain, k)

    @app.post("/admin/engines/{k}/remove")
    async def remove(k: int, request: Request):
        engines_api()
        timeout_s = _timeout(await _body(request))
        return await asyncio.to_thread(admin.remove, k, timeout_s=timeout_s)

    @app.post("/admin/engines/{k}/role")
    async def role(k: int, request: Request):
        engines_api()
        return await asyncio.to_thread(admin.role, k, (await _body(request)).get("role"))

    @app.post("/admin/engines")
    async def add(request: Request):
        engines_api()
        return await asyncio.to_thread(admin.add, (await _body(request)).get("id"))
