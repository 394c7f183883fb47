"""Fault injection: faults caused on purpose, so tests and benchmarks can watch the server heal.
Off by default. `--fault-injection SPEC` (EngineConfig.fault_injection), one fault or several
joined by ",", each a kind and its fields joined by ":":

    kill:rank=1:step=40          rank 1 kills itself (SIGKILL) once 40 steps ran (step=0: at once)
    delay:rank=1:ms=200:step=10  rank 1 sleeps 200 ms after each step from its 10th on
    delay:rank=0:ms=300:replica=1  with replicas: only replica 1's rank 0 (any kind takes replica=)
    drop:rank=1:step=5           from its 5th step rank 1's messages are lost: it stops taking part
                                 (alive, its heartbeat beating), so its peers wait on it until
                                 the launcher's collective timeout; rank 0's reports stop too

`rank` is the rank within the engine (0 .. its ranks - 1); `step` counts the steps that ran a
forward since the ranks started, so a restarted engine meets the same fault again (a kill at
step 0 is a crash loop). engine/rank/faults.py applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

from atoll.errors import InputError

FAULT_KINDS = ("kill", "delay", "drop")
_FIELDS = {"kill": ("rank", "step", "replica"), "delay": ("rank", "ms", "step", "replica"),
           "drop": ("rank", "step", "replica")}


@dataclass(frozen=True)
class Fault:
    kind: str
    rank: int
    step: int = 0  # the fault strikes once this many steps ran
    ms: float = 0.0  # delay: milliseconds added to each step
    replica: int | None = None  # only this replica's rank (with replicas; None: every engine's)


@dataclass(frozen=True)
class FaultInjection:
    faults: tuple[Fault, ...]

    @classmethod
    def parse(cls, value) -> "FaultInjection | None":
        """From the flag's text (a FaultInjection passes through; empty text: None)."""
        if value is None or isinstance(value, FaultInjection):
            return value
        if isinstance(value, dict) and isinstance(value.get("faults"), (list, tuple)):  # dataclasses.asdict's
            value = ",".join(":".join([str(f.get("kind"))] + [f"{k}={f[k]}" for k in _FIELDS.get(f.get("kind"), ())
                                                              if f.get(k) is not None]) for f in value["faults"])
        if not isinstance(value, str):
            raise InputError(f"fault_injection must be text such as 'kill:rank=1:step=40', got {type(value).__name__}")
        faults = tuple(_fault(part.strip()) for part in value.split(",") if part.strip())
        return cls(faults) if faults else None

    def for_replica(self, replica: int) -> "FaultInjection | None":
        """The faults replica `replica` meets: those naming it and those naming no replica."""
        faults = tuple(f for f in self.faults if f.replica is None or f.replica == replica)
        return FaultInjection(faults) if faults else None

    def on_rank(self, rank: int) -> list[Fault]:
        return [f for f in self.faults if f.rank == rank]

    def check_ranks(self, world_size: int) -> None:
        """A fault on a rank the engine does not have would never strike: refuse it."""
        for f in self.faults:
            if f.rank >= world_size:
                raise InputError(f"fault_injection {f.kind}: rank={f.rank} is not a rank of this engine "
                                 f"(it has {world_size}: 0..{world_size - 1})")

    def __str__(self) -> str:
        return ",".join(":".join([f.kind] + [f"{k}={getattr(f, k):g}" for k in _FIELDS[f.kind]
                                                     if getattr(f, k) is not None]) for f in self.faults)


def _fault(text: str) -> Fault:
    kind, *pairs = text.split(":")
    if kind not in FAULT_KINDS:
        raise InputError(f"fault_injection {text!r}: the kind {kind!r} is not one of {', '.join(FAULT_KINDS)}")
    values: dict = {}
    for pair in pairs:
        key, eq, raw = pair.partition("=")
        if not eq or key not in _FIELDS[kind]:
            raise InputError(f"fault_injection {text!r}: {pair!r} is not one of {kind}'s fields "
                             f"({', '.join(k + '=' for k in _FIELDS[kind])})")
        values[key] = _number(text, key, raw)
    if "rank" not in values:
        raise InputError(f"fault_injection {text!r}: rank= is missing (the rank within the engine)")
    if kind == "delay" and not values.get("ms"):
        raise InputError(f"fault_injection {text!r}: ms= (the delay in milliseconds, above 0) is missing")
    return Fault(kind, **values)


def _number(text: str, key: str, raw: str):
    try:
        value = float(raw) if key == "ms" else int(raw)
    except ValueError:
        value = None
    if value is None or value < 0 or (key == "ms" and not value > 0):
        what = "a number of milliseconds above 0" if key == "ms" else "a whole number of at least 0"
        raise InputError(f"fault_injection {text!r}: {key}={raw!r} must be {what}")
    return value
