"""The admin API of a disaggregated server (`--prefill/--decode` with `--enable-admin-api`):
its engines, numbered as the job lays them out (the prefill engines first, then the decode
engines), and the changes an operator makes to them within the ranks the server holds. The
routes are serve.admin's (mount_admin); this is what they do here.

    GET  /admin/engines               every engine: id, name, role, layout, state, health, load
                                      and the requests it took (a prefill engine's: the prompts
                                      it prefilled; a decode engine's: the requests it decoded)
    POST /admin/engines/{id}/drain    no new prompt (prefill) or request and hand-off (decode)
                                      goes to it; what it runs finishes there
    POST /admin/engines               {"id": K} or {}: a drained engine serves again
    POST /admin/engines/{id}/remove   a drain: the engine's ranks stay up and idle (a job's ranks
                                      share one world; it cannot lose some)
    POST /admin/engines/{id}/role     {"role": "prefill" | "decode"}: a drained, idle engine whose
                                      layout is the role's (--prefill's or --decode's) takes the
                                      role at its ranks' next step boundary; it stays drained

An engine's state: serving, draining (requests still running there), drained, or dead.
The last serving decode engine cannot be drained; the last prefill engine can (the decode
engines then prefill every prompt themselves). Refusals are one line with 400, 404 or 409.
"""

from __future__ import annotations

import sys
import threading

from atoll.engine.disagg.routing import EngineStateError
from atoll.serve.admin import AdminError


class DisaggAdmin:
    """What the admin API does to a disaggregated engine. current(): the live DisaggEngine (a
    healing server's restarts make a new one, whose engines all serve again)."""

    def __init__(self, current, *, log=None, api: bool = True):
        self.current, self.api = current, api
        self.log = log or (lambda line: print(f"atoll: admin: {line}", file=sys.stderr, flush=True))
        self._lock = threading.Lock()  # one change at a time
        self.scaler = None  # GET /admin/autoscale: the threshold decisions, where --autoscale is on
        self.predictor = None

    def _call(self, fn, *args):
        """fn(*args) on the live engine, its refusal as the admin API's one line."""
        try:
            return fn(*args)
        except EngineStateError as e:
            raise AdminError(e.status, str(e), param="role" if e.status == 400 else "id",
                             code="engine_not_found" if e.status == 404 else "engine_state") from None

    def _row(self, row: dict) -> dict:
        if row["dead"] is not None:
            state = "dead"
        elif row["off"]:
            state = "draining" if row["unfinished"] else "drained"
        else:
            state = "serving"
        stats = row["stats"]
        return {"id": row["id"], "name": row["name"], "role": row["role"], "colocated": row["colocated"],
                "layout": row["layout"], "state": state,
                "health": "ok" if row["dead"] is None else row["dead"],
                "load": {"running": stats.get("running", 0), "waiting": stats.get("waiting", 0),
                         "unfinished": row["unfinished"]},
                "kv": {"blocks_in_use": stats.get("blocks_in_use", 0), "blocks_total": stats.get("num_blocks", 0)},
                "taken": row["taken"]}

    def list(self) -> list[dict]:
        return [self._row(row) for row in self.current().engine_table()]

    def describe(self, k: int) -> dict:
        rows = self.list()
        self._call(self.current().routing.engine, k)
        return rows[k]

    def drain(self, k: int, *, why: str = "asked") -> dict:
        with self._lock:
            engine = self.current()
            if self._call(engine.drain_engine, k):
                self.log(f"{engine.live.name(k)} (engine {k}) draining ({why})")
        return self.describe(k)

    def remove(self, k: int, *, timeout_s: float = 0.0, why: str = "asked") -> dict:
        """A drain: the engine's ranks stay in the job's world, idle (timeout_s is not waited)."""
        return self.drain(k, why=why)

    def add(self, k: int | None = None, *, why: str = "asked") -> dict:
        with self._lock:
            engine = self.current()
            if k is None:
                off = sorted(engine.routing.off)
                if not off:
                    raise AdminError(409, "no drained engine: every engine this server holds serves",
                                     code="engine_state")
                k = off[0]
            if self._call(engine.serve_engine, k):
                self.log(f"{engine.live.name(k)} (engine {k}) serving again ({why})")
        return self.describe(k)

    def role(self, k: int, role) -> dict:
        """A drained, idle engine of the role's layout takes the role; it stays drained (serve it
        again with POST /admin/engines)."""
        with self._lock:
            engine = self.current()
            self._call(engine.routing.engine, k)
            if self._call(engine.switch_engine, k, role):
                self.log(f"{engine.live.name(k)} (engine {k}) is a {role} engine now, drained")
        return self.describe(k)
