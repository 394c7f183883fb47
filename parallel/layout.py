"""Layout: how one model replica is split over ranks.

tp: tensor parallel (attention and dense MLP), pp: pipeline stages, dp: attention data
parallel inside a stage, ep: expert parallel, moe_tp: tensor parallel inside each expert,
cp: context parallel (each cp rank computes a share of a prompt's tokens and keeps a share of
every sequence's KV blocks; layers/context_parallel.py). One pipeline stage holds
tp * dp * cp ranks; the MoE layers see each cp rank's tp * dp ranks as an ep x moe_tp grid,
so tp * dp == ep * moe_tp. cp does not combine with dp or ep yet.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from atoll.errors import InputError, LayoutError

_TOKEN = re.compile(r"(MOETP|TP|PP|DP|EP|CP)(\d+)", re.IGNORECASE)
_EXAMPLES = "e.g. TP8, TP8PP2, TP4EP4, DP4EP4, EP16, TP2CP2"


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    pp: int = 1
    dp: int = 1
    ep: int = 1
    moe_tp: int = field(default=0)  # 0: derived as tp * dp // ep
    cp: int = 1

    def __post_init__(self):
        for name in ("tp", "pp", "dp", "ep", "moe_tp", "cp"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise LayoutError(f"{name}={value!r} must be a positive integer")
            if value == 0 and name != "moe_tp":
                raise LayoutError(f"{name}=0 must be a positive integer")
        stage = self.tp * self.dp
        if self.moe_tp == 0:
            if stage % self.ep:
                raise LayoutError(
                    f"ep={self.ep} does not divide the stage's tp*dp={stage} ranks; "
                    f"ep must be one of {', '.join(map(str, divisors(stage)))}"
                )
            object.__setattr__(self, "moe_tp", stage // self.ep)
        if self.ep * self.moe_tp != stage:
            raise LayoutError(
                f"ep*moe_tp={self.ep}*{self.moe_tp}={self.ep * self.moe_tp} must equal "
                f"tp*dp={self.tp}*{self.dp}={stage}: the MoE layers use the stage's ranks"
            )
        if self.cp > 1 and (self.dp > 1 or self.ep > 1):
            raise LayoutError(f"cp={self.cp} does not combine with dp or ep yet: use TP, CP and PP only")

    @property
    def world_size(self) -> int:
        return self.tp * self.dp * self.cp * self.pp

    @property
    def stage_size(self) -> int:
        """Ranks of one pipeline stage: tp * dp * cp."""
        return self.tp * self.dp * self.cp

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """Parse "TP2PP2", "DP4EP4", "TP4EP4MOETP1", "TP2CP2". EP alone means TP attention: EP16 = TP16EP16."""
        s = str(text).strip().replace("x", "").replace("X", "").replace("-", "").replace("_", "")
        pos, values = 0, {}
        for m in _TOKEN.finditer(s):
            if m.start() != pos:
                break
            key = {"moetp": "moe_tp"}.get(m.group(1).lower(), m.group(1).lower())
            if key in values:
                raise LayoutError(f"layout {text!r} names {key.upper()} twice")
            values[key] = int(m.group(2))
            pos = m.end()
        if pos != len(s) or not values:
            raise LayoutError(f"cannot parse layout {text!r}: expected {_EXAMPLES}")
        if "ep" in values and "tp" not in values and "dp" not in values:
            values["tp"] = values["ep"] * values.get("moe_tp", 1)
        return cls(**values)

    def __str__(self) -> str:
        parts = []
        if self.tp > 1:
            parts.append(f"TP{self.tp}")
        if self.dp > 1:
            parts.append(f"DP{self.dp}")
        if self.ep > 1:
            parts.append(f"EP{self.ep}")
            if self.moe_tp > 1:
                parts.append(f"MOETP{self.moe_tp}")
        if self.cp > 1:
            parts.append(f"CP{self.cp}")
        if self.pp > 1:
            parts.append(f"PP{self.pp}")
        return "".join(parts) or "TP1"

    def shrunk(self, lost: int = 1) -> "Layout":
        """The layout a DP-attention/EP engine goes on at after losing `lost` ranks (elastic EP:
        DP4EP4 -> DP3EP3); each rank is one DP attention rank and one EP rank."""
        if self.tp != 1 or self.pp != 1 or self.cp != 1 or self.dp != self.ep or self.dp < 2:
            raise LayoutError(f"layout {self}: only DPnEPn (n >= 2) goes on without a lost rank")
        if not 0 < lost < self.dp:
            raise LayoutError(f"layout {self} cannot lose {lost} of its {self.dp} ranks and go on")
        return Layout(dp=self.dp - lost, ep=self.ep - lost)

    def validate(self, config, world_size: int | None = None) -> "Layout":
        """Check against a ModelConfig (and a world size); raise LayoutError naming the numbers."""
        if world_size is not None and world_size != self.world_size:
            raise LayoutError(f"layout {self} needs {self.world_size} ranks, got {world_size}")
        heads, kv = config.num_attention_heads, config.num_key_value_heads
        if not config.is_mla:
            ok = [t for t in divisors(heads) if (kv % t == 0 or t % kv == 0)]
            if heads % self.tp or (kv % self.tp and self.tp % kv):
                raise LayoutError(
                    f"tp={self.tp} does not divide num_attention_heads={heads} "
                    f"(num_key_value_heads={kv}); tp must be one of {', '.join(map(str, ok))}"
                )
        elif heads % self.tp:
            raise LayoutError(
                f"tp={self.tp} does not divide num_attention_heads={heads}; tp must be one of "
                f"{', '.join(map(str, divisors(heads)))}"
            )
        if self.pp > config.num_hidden_layers:
            raise LayoutError(
                f"pp={self.pp} exceeds num_hidden_layers={config.num_hidden_layers}: "
                "every stage needs at least one layer"
            )
        if self.cp > 1 and config.is_mla:
            raise LayoutError(f"layout {self}: context parallelism does not cover MLA attention "
                              f"({config.model_type}) yet")
        if self.ep > 1 and not config.is_moe:
            raise LayoutError(
                f"layout {self} uses expert parallelism but {config.model_type} is a dense model"
            )
        if config.is_moe:
            if self.ep > config.num_experts:
                raise LayoutError(f"ep={self.ep} exceeds num_experts={config.num_experts}")
            inter = config.moe_intermediate_size
            if inter % self.moe_tp:
                raise LayoutError(
                    f"moe_tp={self.moe_tp} does not divide moe_intermediate_size={inter}"
                )
        elif config.intermediate_size % self.tp:
            raise LayoutError(
                f"tp={self.tp} does not divide intermediate_size={config.intermediate_size}"
            )
        return self


def resolve_layout(layout=None, tp: int | None = None, pp: int | None = None,
                   dp: int | None = None, ep: int | None = None, cp: int | None = None) -> Layout:
    """A Layout from its text ("TP2PP2") or from vLLM-style sizes (-tp, -pp, -dp, -ep, -cp)."""
    if layout is not None:
        if any(v is not None for v in (tp, pp, dp, ep, cp)):
            raise InputError("give either --layout or the -tp/-pp/-dp/-ep sizes, not both (-cp is one of them)")
        return layout if isinstance(layout, Layout) else Layout.parse(layout)
    for flag, v in (("-tp", tp), ("-pp", pp), ("-dp", dp), ("-ep", ep), ("-cp", cp)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
            raise InputError(f"{flag} {v!r} must be a whole number of at least 1")
    if ep and not tp and not dp:
        tp = ep  # as in Layout.parse: EP alone means TP attention over the same ranks
    return Layout(tp=tp or 1, pp=pp or 1, dp=dp or 1, ep=ep or 1, cp=cp or 1)
