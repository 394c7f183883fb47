"""The admin API's changes to a disaggregated driver's engines (engine/driver/disagg.py's
DisaggEngine mixes this in; serve.admin_disagg calls it): drain one, serve it again, change a
drained one's role, and the table GET /admin/engines lists. The rules are engine.disagg.routing's;
this applies them under the driver's lock, to its state (_load, _waiting, _slots, _seen, _dead).
"""

from __future__ import annotations

import math

from atoll.engine.disagg.routing import EngineStateError


class EngineChanges:
    """What DisaggEngine does when the admin API changes its engines."""

    def drain_engine(self, k: int) -> bool:
        """The admin API's drain (engine.disagg.routing): False if engine k was drained already."""
        with self._lock:
            return self.routing.drain(k, self._dead)

    def serve_engine(self, k: int) -> bool:
        """Engine k, drained, serves again: False if it served already."""
        with self._lock:
            return self.routing.serve(k, self._dead)

    def switch_engine(self, k: int, role) -> bool:
        """Drained engine k takes `role` (engine.disagg.routing's refusals): its ranks swap their
        hooks at their next step boundary, before any request the driver sends it in that role
        (its inbox keeps the order). It stays drained. False: it had that role already."""
        with self._lock:
            busy = sum(self._load[s] for s, (j, _) in enumerate(self._slots) if j == k) \
                + (self._waiting[k] if self._waiting[k] != math.inf else 0)
            if k in self._dead:
                raise EngineStateError(409, f"engine {k} is dead: it cannot change role within this job")
            if not self.routing.switch(k, role, busy):
                return False
            for s, (j, _) in enumerate(self._slots):
                if j == k:  # what it caches is heard of again as it names blocks in the decode role
                    self._seen[s].clear()
            self._inboxes[k].put(("role", role))
        return True

    def _role(self, role: str) -> list[int]:
        return [e for e, r in enumerate(self.routing.roles) if r == role]

    def engine_table(self) -> list[dict]:
        """Each engine: id, name, role, whether it is a colocated decode engine, layout, whether it
        is drained, its unfinished requests (a prefill engine's: those not handed off yet), the
        requests it took, and why it is dead."""
        with self._lock:
            out = []
            for e, layout in enumerate(self.layouts):
                if self.routing.roles[e] == "prefill":
                    busy = self._waiting[e]
                else:
                    busy = sum(self._load[s] for s, (j, _) in enumerate(self._slots) if j == e)
                name = self.live.name(e)
                out.append({"id": e, "name": name, "role": self.routing.roles[e],
                            "colocated": e in self.routing.colocated, "layout": str(layout),
                            "off": e in self.routing.off, "unfinished": 0 if busy == math.inf else busy,
                            "taken": self.taken[e], "dead": self._dead.get(e),
                            "stats": dict(self._engine_stats.get(name, {}))})
            return out

    def recent_remote_prompts(self) -> tuple[tuple[float, int], ...]:
        """(monotonic seconds, uncached prompt tokens) of the last prompts sent to prefill engines
        (the autoscaler's threshold raise reads them)."""
        with self._lock:
            return tuple(self.remote_prompts)
