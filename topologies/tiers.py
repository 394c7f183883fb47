"""The KV cache tiers' bandwidths on a machine: how fast a rank's blocks move between its cache
and host memory, and between host memory and a local disk (engine/kv/tiers). A topology YAML
may give them, and `atoll calibrate` writes the ones it measured here:

    kv_tiers:
      host: {read_gb_s: 9.1, write_gb_s: 8.7}     # a block's bytes copied in host memory, per rank
      disk: {read_gb_s: 1.9, write_gb_s: 0.8, latency_us: 120}   # block files, one node's ranks together

GB/s are 1e9 bytes/s of block payload. A figure left out is the planner's sourced default for
the machine (planner/tiers.py: the PCIe link to the GPU, a data-centre NVMe drive), so the
presets say nothing here.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from atoll.errors import ConfigError

TIER_NAMES = ("host", "disk")
FIELDS = ("read_gb_s", "write_gb_s", "latency_us")


@dataclass(frozen=True)
class TierLink:
    """One tier's figures; None where not given (the planner's default then)."""
    read_gb_s: float | None = None
    write_gb_s: float | None = None
    latency_us: float | None = None  # a read's fixed cost, whatever its size

    def to_dict(self) -> dict:
        return {k: getattr(self, k) for k in FIELDS if getattr(self, k) is not None}


@dataclass(frozen=True)
class KvTierLinks:
    host: TierLink = TierLink()
    disk: TierLink = TierLink()

    def to_dict(self) -> dict:
        """The YAML mapping; empty when nothing is given."""
        out = {name: getattr(self, name).to_dict() for name in TIER_NAMES}
        return {k: v for k, v in out.items() if v}


def kv_tiers_from_dict(d, where: str) -> KvTierLinks:
    """A topology's `kv_tiers:` mapping; ConfigError (one line) for an unknown field or a figure
    that is not a positive finite number (latency_us may be 0)."""
    if d is None:
        return KvTierLinks()
    if not isinstance(d, dict) or set(d) - set(TIER_NAMES):
        raise ConfigError(f"{where}: kv_tiers holds {' and '.join(TIER_NAMES)}, each a mapping of {', '.join(FIELDS)}")
    links = {}
    for name, fig in d.items():
        if not isinstance(fig, dict) or set(fig) - set(FIELDS):
            raise ConfigError(f"{where}: kv_tiers.{name} must be a mapping of {', '.join(FIELDS)}")
        for k, v in fig.items():
            ok = isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) \
                and (v >= 0 if k == "latency_us" else v > 0)
            if not ok:
                raise ConfigError(f"{where}: kv_tiers.{name}.{k}={v!r} must be a "
                                  f"{'non-negative' if k == 'latency_us' else 'positive'} number")
        links[name] = TierLink(**{k: float(v) for k, v in fig.items()})
    return KvTierLinks(**links)
