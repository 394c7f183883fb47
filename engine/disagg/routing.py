"""Which engines of a disaggregated job the driver routes to: each engine's role and whether it
serves or is drained (the admin API's drain and serve again), as plain Python over lists.

Engines are numbered as the job lays them out: the X prefill engines 0 .. X-1, then the Y
decode engines X .. X+Y-1. A drained prefill engine is given no new prompt: it reads as full,
as a dead one does (engine.disagg.decision.choose_path), so the prompt goes to another prefill
engine or, with none serving, is prefilled by its decode replica. A drained decode engine is
given no new request and no hand-off; what it runs finishes there. The last serving decode
engine is never drained. The last prefill engine may be: its decode engines then prefill every
prompt themselves (local prefill takes any prompt a prefill engine would). A colocated decode
engine (--colocated-replicas) prefills every prompt it takes and is given no hand-off; it is a
plain decode engine once its role has changed.

A drained engine, idle, whose layout is the other role's (the job's --prefill or --decode
layout) may change role: its rank loop swaps its hooks at a step boundary
(engine.disagg.roles.EngineRoles) and the driver routes to it in its new role once it serves
again. Every engine's decode replicas are slots of the driver's table; those of an engine not in
the decode role take nothing.
"""

from __future__ import annotations

import math

from atoll.errors import AtollError
from atoll.parallel.layout import Layout

ROLES = ("prefill", "decode")


class EngineStateError(AtollError):
    """A change the engines' states do not allow, with the HTTP status the admin API answers
    (404: no such engine, 409: not in a state that allows it)."""

    def __init__(self, status: int, line: str):
        super().__init__(line)
        self.status = status


class Routing:
    """Each engine's role and the engines taken out of routing (drained or draining)."""

    def __init__(self, layouts: list[Layout], prefill_replicas: int, colocated: int = 0):
        self.layouts = list(layouts)
        self.roles = ["prefill"] * prefill_replicas + ["decode"] * (len(self.layouts) - prefill_replicas)
        # decode engines that prefill every prompt themselves (the last `colocated`); a role change ends it
        self.colocated: set[int] = set(range(len(self.layouts) - colocated, len(self.layouts)))
        # the layout each role runs (the job's): an engine takes a role only with its layout
        self.role_layouts = {"prefill": self.layouts[0], "decode": self.layouts[-1]}
        self.off: set[int] = set()  # engines that take nothing new

    def engine(self, k) -> int:
        """Engine id k checked (404 for one the job does not hold)."""
        count = len(self.layouts)
        if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k < count:
            raise EngineStateError(404, f"engine {k!r} does not exist: this server holds engines 0..{count - 1}")
        return k

    def serving(self, role: str, dead=()) -> list[int]:
        return [e for e, r in enumerate(self.roles) if r == role and e not in self.off and e not in dead]

    def drain(self, k: int, dead=()) -> bool:
        """Take engine k out of routing; False if it was out already. Refuses the last serving
        decode engine and an engine that is dead."""
        k = self.engine(k)
        if k in dead:
            raise EngineStateError(409, f"engine {k} is dead: only a serving engine can be drained")
        if k in self.off:
            return False
        if self.roles[k] == "decode" and self.serving("decode", dead) == [k]:
            raise EngineStateError(409, f"engine {k} is the last decode engine serving: serve another before "
                                        "draining it")
        self.off.add(k)
        return True

    def serve(self, k: int, dead=()) -> bool:
        """Engine k serves again; False if it served already."""
        k = self.engine(k)
        if k in dead:
            raise EngineStateError(409, f"engine {k} is dead: it cannot serve again within this job")
        if k not in self.off:
            return False
        self.off.discard(k)
        return True

    def check_role(self, k: int, role, busy: int) -> bool:
        """Whether engine k may take `role` (False: it has it already); refuses, in one line, an
        unknown role, an engine still serving or running requests (busy), and an engine whose
        layout differs from the role's (the job's --prefill or --decode layout: the KV hand-off
        and the prefill engines' byte counts assume it)."""
        k = self.engine(k)
        if role not in ROLES:
            raise EngineStateError(400, f"role={role!r}: choose one of {', '.join(ROLES)}")
        if self.roles[k] == role:
            return False
        if k not in self.off or busy:
            state = "serving" if k not in self.off else f"draining ({busy} request(s) running)"
            raise EngineStateError(409, f"engine {k} is {state}: drain it, and let it finish, before changing "
                                        "its role")
        if self.layouts[k] != self.role_layouts[role]:
            raise EngineStateError(409, f"engine {k} runs {self.layouts[k]} but the {role} engines run "
                                        f"{self.role_layouts[role]}: a role change keeps the engine's layout")
        return True

    def switch(self, k: int, role, busy: int) -> bool:
        """Engine k takes `role` (check_role's refusals); it stays drained. False: it had it."""
        if not self.check_role(k, role, busy):
            return False
        self.roles[k] = role
        self.colocated.discard(k)
        return True

    def prefill_waiting(self, waiting: list[float]) -> list[float]:
        """The prefill engines' queues as the path decision reads them: a drained one reads as full."""
        return [math.inf if e in self.off or self.roles[e] != "prefill" else w for e, w in enumerate(waiting)]

    def least_loaded(self, load: list[float], slots: list[tuple[int, int]]) -> int:
        """The decode replica (index into slots [(engine, replica)], every engine's) with the
        fewest unfinished requests among the serving engines in the decode role."""
        live = [s for s, (e, _) in enumerate(slots) if e not in self.off and self.roles[e] == "decode"]
        if not live:  # (never drained: the last decode engine is dead) the decode engines', to fail there
            live = [s for s, (e, _) in enumerate(slots) if self.roles[e] == "decode"]
        return min(live, key=lambda s: (load[s], s))
