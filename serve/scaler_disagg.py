"""What --autoscale changes on a disaggregated server (engine.driver.disagg.DisaggEngine), through
the same calls as its admin API (engine.driver.disagg_engines):

- threshold: the local-prefill threshold (its min_prompt_tokens, read at each arrival);
- add ROLE: a drained engine serves again, in ROLE (one of that role first; else one of the
  role's layout that is idle takes the role);
- role ROLE: the least loaded serving engine of the other role, of ROLE's layout, is drained
  now; once nothing runs there (a later look) it takes ROLE and serves again. Until then it
  counts as neither role, and decide's interval and settle keep the next decision away.

A decision nothing can take (no engine free, none of the layout) is logged and counted as not
applied. serve.autoscale.decide makes them, with its hysteresis.
"""

from __future__ import annotations

from atoll.engine.disagg.routing import EngineStateError
from atoll.serve.autoscale import Fleet


class DisaggTarget:
    """current(): the live DisaggEngine (a healing job's is a new one after each restart, which
    gets the threshold the autoscaler last set, every engine in its launch role)."""

    def __init__(self, current, log):
        self.current, self.log = current, log
        self.base = current().min_prompt_tokens
        self.threshold: int | None = None  # the last one set
        self.turning: tuple[object, int, str] | None = None  # (its engine, engine id, the role it takes once idle)

    @property
    def engine(self):
        e = self.current()
        if self.threshold is not None and e.min_prompt_tokens != self.threshold:
            e.min_prompt_tokens = self.threshold  # a restarted job starts at the flag's
        return e

    def stats(self) -> dict:
        return self.engine.stats

    def fleet(self) -> Fleet:
        e = self.engine
        self._finish_turn(e)
        rows = [r for r in e.engine_table() if r["dead"] is None]
        serving = [r["role"] for r in rows if not r["off"]]
        turning = self.turning[1] if self.turning is not None else None
        return Fleet(prefill=serving.count("prefill"), decode=serving.count("decode"),
                     free=sum(r["off"] and r["id"] != turning for r in rows), threshold=e.min_prompt_tokens,
                     base_threshold=self.base, remote_prompts=e.recent_remote_prompts())

    def act(self, d) -> tuple[int | None, bool]:
        """(the engine it touched, whether the decision was applied)."""
        e = self.engine
        if d.action == "threshold":
            self.threshold = e.min_prompt_tokens = d.threshold
            return None, True
        if d.action == "add":
            return self._add(e, d.role, d.reason)
        if d.action == "role" and self.turning is None:
            return self._turn(e, d.role, d.reason)
        return None, False

    def _add(self, e, role: str, reason: str) -> tuple[int | None, bool]:
        rows = [r for r in e.engine_table() if r["dead"] is None and r["off"]]
        same = [r["id"] for r in rows if r["role"] == role]
        other = [r["id"] for r in rows if r["role"] != role and not r["unfinished"]
                 and e.layouts[r["id"]] == e.routing.role_layouts[role]]
        if not same and not other:
            return None, False
        k = (same or other)[0]
        if not same:
            e.switch_engine(k, role)
        e.serve_engine(k)
        self.log(f"autoscale: {e.live.name(k)} (engine {k}) serving as a {role} engine ({reason})")
        return k, True

    def _turn(self, e, role: str, reason: str) -> tuple[int | None, bool]:
        rows = [r for r in e.engine_table() if r["dead"] is None and not r["off"] and r["role"] != role
                and e.layouts[r["id"]] == e.routing.role_layouts[role]]
        if len(rows) < 2 and rows and rows[0]["role"] == "decode":
            rows = []  # the last decode engine never turns
        if not rows:
            return None, False
        k = min(reversed(rows), key=lambda r: r["unfinished"])["id"]  # the least loaded, the last
        try:
            e.drain_engine(k)
        except EngineStateError:  # it died, or the engines changed since the table was read
            return None, False
        self.turning = (e, k, role)
        self.log(f"autoscale: {e.live.name(k)} (engine {k}) draining, to turn {role} once idle ({reason})")
        return k, True

    def _finish_turn(self, e) -> None:
        """The engine being turned takes its role and serves again once nothing runs there (a
        restarted job's engines start in their launch roles: the turn is dropped)."""
        if self.turning is None:
            return
        was, k, role = self.turning
        if was is not e:
            self.turning = None
            return
        row = e.engine_table()[k]
        if row["dead"] is not None:
            self.turning = None
        elif not row["unfinished"]:
            self.turning = None
            try:
                e.switch_engine(k, role)
                e.serve_engine(k)
            except EngineStateError as err:  # an operator changed it meanwhile (the admin API)
                self.log(f"autoscale: {e.live.name(k)} (engine {k}) not turned {role}: {err}")
                return
            self.log(f"autoscale: {e.live.name(k)} (engine {k}) is a {role} engine now, serving")
