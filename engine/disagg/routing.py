"""Which engines of a disaggregated job the driver routes to: each engine's role and whether it
serves or is drained (the admin API's drain and serve again), as plain Python over lists.

Engines are numbered as the job lays them out: the X prefill engines 0 .. X-1, then the Y
decode engines X .. X+Y-1. A drained prefill engine is given no new prompt: it reads as full,
as a dead one does (engine.disagg.decision.choose_path), so the prompt goes to another prefill
engine or, with none serving, is prefilled by its decode replica. A drained decode engine is
given no new request and no hand-off; what it runs finishes there. The last serving decode
engine is never drained. The last prefill engine may be: its decode engines then prefill every
prompt themselves (local prefill takes any prompt a prefill engine would).
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

    def __init__(self, layouts: list[Layout], prefill_replicas: int):
        self.layouts = list(layouts)
        self.roles = ["prefill"] * prefill_replicas + ["decode"] * (len(self.layouts) - prefill_replicas)
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
        layout differs from the layout of the role's engines."""
        k = self.engine(k)
        if role not in ROLES:
            raise EngineStateError(400, f"role={role!r}: choose one of {', '.join(ROLES)}")
        if self.roles[k] == role:
            return False
        if k not in self.off or busy:
            state = "serving" if k not in self.off else f"draining ({busy} request(s) running)"
            raise EngineStateError(409, f"engine {k} is {state}: drain it, and let it finish, before changing "
                                        "its role")
        others = sorted({str(self.layouts[e]) for e, r in enumerate(self.roles) if r == role})
        if others and others != [str(self.layouts[k])]:
            raise EngineStateError(409, f"engine {k} runs {self.layouts[k]} but the {role} engines run "
                                        f"{', '.join(others)}: a role change keeps the engine's layout")
        return True

    def prefill_waiting(self, waiting: list[float]) -> list[float]:
        """The prefill engines' queues as the path decision reads them: a drained one reads as full."""
        return [math.inf if e in self.off else w for e, w in enumerate(waiting)]

    def least_loaded(self, load: list[float], slots: list[tuple[int, int]], x: int) -> int:
        """The decode replica (index into slots [(decode engine j, replica)]) with the fewest
        unfinished requests among the serving decode engines (x: the prefill engines' count)."""
        live = [s for s, (j, _) in enumerate(slots) if x + j not in self.off]
        return min(live or range(len(slots)), key=lambda s: (load[s], s))
