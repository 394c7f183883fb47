"""EngineJob: what every rank of a job gets (picklable), whatever runs it: one colocated engine,
or X prefill engines then Y decode engines (xPyD), each with its own spec and layout, its ranks
one after another in job rank order (parallel.parts). A rank's role is its engine's."""

from __future__ import annotations

from dataclasses import dataclass

from atoll.engine.rank.run_spec import RunSpec
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ContextOptions

ROLES = ("colocated", "prefill", "decode")


@dataclass(frozen=True)
class EngineJob:
    specs: tuple[RunSpec, ...]  # one per engine, in job rank order
    roles: tuple[str, ...]  # each engine's role: "colocated" (alone), or "prefill" engines then "decode" ones
    options: ContextOptions | None = None  # islands and nodes
    link_stats: bool = False  # count each engine's bytes by link class (parallel.links), sent as it stops
    cache_events: bool = False  # a colocated engine's steps report the blocks its pools name and evict
    elastic_store: str | None = None  # --elastic-ep: "host:port" of the store the driver serves (comm/regroup.py)

    def __post_init__(self):
        if len(self.specs) != len(self.roles) or not self.specs:
            raise ValueError(f"an EngineJob needs one role per engine: {len(self.specs)} specs, {len(self.roles)} roles")
        bad = [r for r in self.roles if r not in ROLES]
        if bad:
            raise ValueError(f"unknown engine role {bad[0]!r}: one of {', '.join(ROLES)}")
        if "colocated" in self.roles and len(self.roles) > 1:
            raise ValueError("a colocated engine runs alone in its job")
        if len({s.engine.kernels for s in self.specs}) > 1:
            raise ValueError("the engines of one job take one kernel path (their configs' kernels differ)")

    @classmethod
    def colocated(cls, spec: RunSpec, options: ContextOptions | None = None, *, link_stats: bool = False,
                  cache_events: bool = False):
        return cls((spec,), ("colocated",), options, link_stats, cache_events)

    @classmethod
    def disaggregated(cls, prefill: RunSpec, decode: RunSpec, options: ContextOptions | None = None, *,
                      prefill_replicas: int = 1, decode_replicas: int = 1):
        specs = tuple(prefill.for_engine(f"prefill{i}") for i in range(prefill_replicas))
        specs += tuple(decode.for_engine(f"decode{j}") for j in range(decode_replicas))
        return cls(specs,
                   ("prefill",) * prefill_replicas + ("decode",) * decode_replicas, options)

    @property
    def kernels(self) -> str:
        """The job's kernel path (kernels.backend), its engines' configs' `kernels`."""
        return self.specs[0].engine.kernels

    @property
    def layouts(self) -> list[Layout]:
        return [Layout.parse(s.layout) for s in self.specs]

    @property
    def world_size(self) -> int:
        return sum(lay.world_size for lay in self.layouts)

    @property
    def prefill_replicas(self) -> int:
        return self.roles.count("prefill")

    @property
    def decode_replicas(self) -> int:
        return len(self.roles) - self.prefill_replicas

    @property
    def decode(self) -> RunSpec:
        """The spec of the engine that decodes (the colocated one, or the first decode engine)."""
        return self.specs[self.prefill_replicas]

    @property
    def prefill(self) -> RunSpec | None:
        return self.specs[0] if self.prefill_replicas else None

    def name(self, engine: int) -> str | None:
        """Engine `engine`'s label: None when colocated, "prefill engine", "decode engine" (one
        of its kind) or "prefill engine 1", "decode engine 0"."""
        role = self.roles[engine]
        if role == "colocated":
            return None
        k = engine if role == "prefill" else engine - self.prefill_replicas
        n = self.roles.count(role)
        return f"{role} engine" if n == 1 else f"{role} engine {k}"
