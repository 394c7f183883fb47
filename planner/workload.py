"""Workload: what the operator asks the cluster to serve."""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

from atoll.config import resolve
from atoll.errors import ConfigError
from atoll.engine.kv.sizing import storage_bytes

DTYPES = ("bf16", "fp8", "fp32")
MAX_CONCURRENCY = 10_000_000  # requests in flight the planner costs (a bound, so a typo fails in one line)
MAX_RATE = 1e9  # requests per second
_BYTES = {"bf16": 2, "fp8": 1, "fp32": 4}
# the KV cache also takes the runtime's --kv-cache-dtype names (fp8 = fp8_e4m3; int8 adds a scale)
KV_DTYPES = DTYPES + ("fp8_e4m3", "fp8_e5m2", "int8")
SPEC_METHODS = ("ngram", "mtp")
MAX_SPEC_TOKENS = 16
MAX_REDUNDANT = 4096  # spare expert slots (a bound, so a typo fails in one line)


@dataclass(frozen=True)
class Workload:
    isl: int = 1024  # input (prompt) tokens per request
    osl: int = 256  # output tokens per request
    concurrency: int = 64  # requests in flight across the whole cluster
    dtype: str = "auto"  # weight precision of the decoder layers; auto: the checkpoint's (checkpoint_dtype)
    kv_dtype: str = "auto"  # KV cache precision (KV_DTYPES); auto: bf16 below fp32 weights, else fp32
    # new requests per second across the cluster (Poisson arrivals, open loop); None: closed loop,
    # each of the `concurrency` clients sends its next request when its last one ends
    request_rate: float | None = None
    # (token, expert) pairs on the busiest EP rank over the mean (1.0: perfectly balanced
    # routing); None: planner/moe_cost.py's sourced EXPERT_IMBALANCE carried to the layout
    # (moe_cost.expert_imbalance)
    expert_imbalance: float | None = None
    # EPLB (the runtime's --enable-eplb, --num-redundant-experts): experts placed by load over
    # E + redundant_experts slots; without it the contiguous blocks. expert_loads: tokens per
    # logical expert, one tuple a MoE layer, from a recorded load file (planner/expert_balance.py);
    # None: the gate model fitted to the sourced imbalance
    eplb: bool = False
    redundant_experts: int = 0
    expert_loads: tuple | None = None
    # the runtime's --quantization (int8, fp8): weights counted by its own rule (planner/quantized.py)
    quantization: str | None = None
    # the engine runs each step as two micro-batches, one's MoE exchange under the other's compute
    # (SGLang's and DeepSeek's "two-batch overlap"); atoll's runtime does not (False)
    two_batch_overlap: bool = False
    # decode steps exchange tokens with DeepEP's low-latency kernels (SGLang's PD-disaggregated
    # decode): each (token, expert) pair straight over RDMA, no island-first forwarding; atoll's
    # runtime dispatches island first (False)
    low_latency_decode: bool = False
    # speculative decoding (the engine's --speculative-config): tokens drafted a step, the chance
    # each drafted token is kept given the one before it was, and what drafts them: "ngram"
    # (prompt lookup, no model) or "mtp" (the checkpoint's next-token layer: a decoder layer and
    # the LM head a drafted token). A step verifies spec_tokens + 1 tokens of every sequence.
    spec_tokens: int = 0
    acceptance: float = 0.0
    spec_method: str = "ngram"

    def __post_init__(self):
        for name in ("isl", "osl", "concurrency"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{name}={v!r} must be a positive integer")
        if self.concurrency > MAX_CONCURRENCY:
            raise ConfigError(f"concurrency={self.concurrency} is past the {MAX_CONCURRENCY:,} requests in flight "
                              "the planner costs")
        if self.request_rate is not None and _positive(self.request_rate) and self.request_rate > MAX_RATE:
            raise ConfigError(f"request_rate={self.request_rate:g} is past the {MAX_RATE:g} requests per second "
                              "the planner costs")
        if self.request_rate is not None and not _positive(self.request_rate):
            raise ConfigError(f"request_rate={self.request_rate!r} must be a positive number of requests per second")
        if self.expert_imbalance is not None and not (_positive(self.expert_imbalance) and self.expert_imbalance >= 1):
            raise ConfigError(f"expert_imbalance={self.expert_imbalance!r} must be a number >= 1 "
                              "(the busiest EP rank's tokens over the mean)")
        if not isinstance(self.eplb, bool):
            raise ConfigError(f"eplb={self.eplb!r} must be true or false")
        if isinstance(self.redundant_experts, bool) or not isinstance(self.redundant_experts, int) or \
                not 0 <= self.redundant_experts <= MAX_REDUNDANT:
            raise ConfigError(f"redundant_experts={self.redundant_experts!r} must be a whole number of spare expert "
                              f"slots, 0 to {MAX_REDUNDANT}")
        if self.redundant_experts and not self.eplb:
            raise ConfigError(f"redundant_experts={self.redundant_experts} needs eplb (--enable-eplb): spare slots are "
                              "filled by load")
        if not isinstance(self.two_batch_overlap, bool):
            raise ConfigError(f"two_batch_overlap={self.two_batch_overlap!r} must be true or false")
        if not isinstance(self.low_latency_decode, bool):
            raise ConfigError(f"low_latency_decode={self.low_latency_decode!r} must be true or false")
        if isinstance(self.spec_tokens, bool) or not isinstance(self.spec_tokens, int) or \
                not 0 <= self.spec_tokens <= MAX_SPEC_TOKENS:
            raise ConfigError(f"spec_tokens={self.spec_tokens!r} must be a whole number of drafted tokens, "
                              f"0 to {MAX_SPEC_TOKENS}")
        if isinstance(self.acceptance, bool) or not isinstance(self.acceptance, (int, float)) or \
                not 0 <= self.acceptance <= 1:
            raise ConfigError(f"acceptance={self.acceptance!r} must be a chance between 0 and 1")
        if self.spec_method not in SPEC_METHODS:
            raise ConfigError(f"spec_method={self.spec_method!r} must be one of {', '.join(SPEC_METHODS)}")
        if self.quantization not in (None, "int8", "fp8"):
            raise ConfigError(f"quantization={self.quantization!r} must be int8 or fp8")
        for name, names in (("dtype", DTYPES), ("kv_dtype", KV_DTYPES)):
            if getattr(self, name) not in names + ("auto",):
                raise ConfigError(f"{name}={getattr(self, name)!r} must be one of {', '.join(names)} or auto")

    def resolved(self, config) -> "Workload":
        """"auto" precisions filled from the model's config; ConfigError when a request's
        isl + osl exceeds the model's context."""
        if self.context > config.max_position_embeddings:
            raise ConfigError(f"isl + osl = {self.isl} + {self.osl} = {self.context} tokens exceeds the model's "
                              f"context of {config.max_position_embeddings} (max_position_embeddings)")
        dtype = checkpoint_dtype(config) if self.dtype == "auto" else self.dtype
        kv = ("fp32" if dtype == "fp32" else "bf16") if self.kv_dtype == "auto" else self.kv_dtype
        return dataclasses.replace(self, dtype=dtype, kv_dtype=kv)

    def _bytes(self, dtype: str) -> int:
        if dtype == "auto":
            raise ConfigError("the workload's precision is still 'auto': call resolved(config) first")
        return _BYTES[dtype]

    @property
    def weight_bytes(self) -> int:
        return self._bytes(self.dtype)

    @property
    def kv_bytes(self) -> int:
        """Bytes per cached value."""
        return self._kv_storage()[0]

    @property
    def kv_scale_bytes(self) -> float:
        """Bytes of scale per token and kv head (int8's float32 scale; 0 otherwise), as the runtime stores it."""
        return self._kv_storage()[1]

    def _kv_storage(self) -> tuple[float, float]:
        if self.kv_dtype in _BYTES or self.kv_dtype == "auto":
            return self._bytes(self.kv_dtype), 0
        return storage_bytes(0, self.kv_dtype)  # engine.kv.sizing: the runtime's own figure

    @property
    def embed_bytes(self) -> int:
        """Embedding and LM head: kept in bf16 under fp8 weights, else the weights' precision."""
        return max(2, self.weight_bytes)

    @property
    def act_bytes(self) -> int:
        """Activations: bf16, or fp32 when the weights are fp32."""
        return max(2, self.weight_bytes)

    @property
    def context(self) -> int:
        """Tokens each request holds in the KV cache at its end."""
        return self.isl + self.osl

    @property
    def tokens_per_step(self) -> float:
        """Tokens a sequence gains a decode step: the verified one, then each drafted token kept
        while every one before it was (1 + a + a^2 + ... + a^k)."""
        return sum(self.acceptance ** i for i in range(self.spec_tokens + 1))

    @property
    def mean_decode_context(self) -> float:
        """Average tokens attended to over the decode of one request."""
        return self.isl + self.osl / 2


def _positive(v) -> bool:
    return not isinstance(v, bool) and isinstance(v, (int, float)) and 0 < v < float("inf")


def checkpoint_dtype(config) -> str:
    """The weights' precision the checkpoint ships in: fp8 when its config.json carries an fp8
    quantization_config (DeepSeek-V3: quant_method fp8, fmt e4m3), fp32 for a float32
    torch_dtype, else bf16 (float16 is costed as bf16: same bytes, same tensor-core rate)."""
    raw = getattr(config, "raw", {}) or {}
    quant = raw.get("quantization_config") or {}
    if isinstance(quant, dict) and str(quant.get("quant_method", "")).lower() == "fp8":
        return "fp8"
    torch_dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "bfloat16")
    return "fp32" if torch_dtype in ("float32", "torch.float32") else "bf16"


@functools.cache
def gather_max_rows() -> int:
    """The rows per ep rank up to which the runtime's MoE layer gathers instead of the
    all-to-all: the config's moe_gather_rows as this process resolves it (its default, or
    ATOLL_MOE_GATHER_ROWS), read once."""
    return resolve().moe_gather_rows
