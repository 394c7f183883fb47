"""Workload: what the operator asks the cluster to serve."""

from __future__ import annotations

from dataclasses import dataclass

from atoll.errors import ConfigError

DTYPES = ("bf16", "fp8")


@dataclass(frozen=True)
class Workload:
    isl: int = 1024  # input (prompt) tokens per request
    osl: int = 256  # output tokens per request
    concurrency: int = 64  # requests in flight across the whole cluster
    dtype: str = "bf16"  # weight precision of the decoder layers
    kv_dtype: str = "bf16"  # KV cache precision

    def __post_init__(self):
        for name in ("isl", "osl", "concurrency"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r} must be a positive integer")
        for name in ("dtype", "kv_dtype"):
            if getattr(self, name) not in DTYPES:
                raise ConfigError(f"{name}={getattr(self, name)!r} must be one of {', '.join(DTYPES)}")

    @property
    def weight_bytes(self) -> int:
        return 1 if self.dtype == "fp8" else 2

    @property
    def kv_bytes(self) -> int:
        return 1 if self.kv_dtype == "fp8" else 2

    @property
    def context(self) -> int:
        """Tokens each request holds in the KV cache at its end."""
        return self.isl + self.osl

    @property
    def mean_decode_context(self) -> float:
        """Average tokens attended to over the decode of one request."""
        return self.isl + self.osl / 2
