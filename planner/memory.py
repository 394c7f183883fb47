"""Memory fit of one GPU: weights of its shard, KV cache for its share of the requests,
activations of one prefill chunk, communication buffers and a fixed reserve.

The worst GPU is the one on the heaviest pipeline stage (the last holds the LM head, the
first the embedding). Every term is arithmetic a reader can redo from the config:
weights = parameters x bytes / shards; KV = requests x (isl + osl) x layers x bytes per token.
With context parallelism (context.py) each of the cp ranks of a sequence holds 1/cp of its KV
and of a prompt chunk's activations, beside a whole copy of its stage's weights.

KV capacity (kv_capacity): the tokens of prefix a replica keeps, in its device pool (what
gpu_memory_utilization leaves after the rest) and in the KV cache tiers below it (engine/kv/tiers:
--kv-offload-gb GiB of host memory per rank, --kv-disk-gb GiB of disk per rank, a shared store).
Every rank holds its own slice of a block, so a tier's blocks are its GiB over one rank's block,
a record of the block's bytes and the engine's header (engine/kv/tiers/record.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from atoll.engine.kv.sizing import static_scale_bytes
from atoll.engine.kv.tiers.record import HEADER
from atoll.planner import efficiency as eff
from atoll.planner.context import partial_bytes_per_token, query_bytes_per_token
from atoll.planner.shapes import stage_split


@dataclass(frozen=True)
class MemoryFit:
    weights: float  # bytes on the worst GPU
    kv_cache: float
    activations: float
    buffers: float  # NCCL / all-to-all buffers
    reserve: float
    capacity: float

    @property
    def used(self) -> float:
        return self.weights + self.kv_cache + self.activations + self.buffers + self.reserve

    @property
    def fits(self) -> bool:
        return self.used <= self.capacity

    @property
    def shortfall(self) -> float:
        return max(0.0, self.used - self.capacity)

    @property
    def weights_fit(self) -> bool:
        return self.weights + self.reserve <= self.capacity

    def describe(self) -> str:
        gib = 2**30
        text = (f"{self.used / gib:.1f}/{self.capacity / gib:.1f} GiB (weights {self.weights / gib:.1f}, "
                f"KV {self.kv_cache / gib:.1f}, act+buf {(self.activations + self.buffers) / gib:.1f}, "
                f"reserve {self.reserve / gib:.1f})")
        if not self.fits:
            text += f"; short by {self.shortfall / gib:.1f} GiB"
        return text


def stage_weight_params(shapes, layout, start: int, end: int, first: bool, last: bool,
                        redundant: int = 0) -> tuple[float, float]:
    """(decoder-layer params, bf16 embedding/head params) one GPU of this stage holds, with
    `redundant` spare expert slots (EPLB's copies) over the ep group."""
    s, l = shapes, layout
    attn = s.attn_sharded / l.tp + s.attn_replicated
    moe = s.experts_per_rank(l.ep, redundant) * s.expert / l.moe_tp + s.shared_expert / l.tp
    layers = sum(attn + (s.dense_mlp / l.tp if s.dense_layers[i] else moe) for i in range(start, end))
    # a tied head is the embedding's tensor where one stage holds both (pp 1)
    head = last and not (s.tied and first)
    extra = (s.embed / l.tp if first else 0) + (s.head / l.tp if head else 0)
    router = sum(s.router for i in range(start, end) if not s.dense_layers[i])
    return layers, extra + router


def memory_fit(config, shapes, topology, workload, layout, batch: int) -> MemoryFit:
    """Per-GPU memory for `batch` concurrent requests on one replica of `layout`."""
    s, l, w = shapes, layout, workload
    cp = layout.cp
    per_dp = math.ceil(batch / l.dp)
    worst = None
    for i, (start, end) in enumerate(stage_split(config, l.pp)):
        dec, bf16 = stage_weight_params(s, l, start, end, i == 0, i == l.pp - 1, w.redundant_experts)
        weights = dec * w.weight_bytes + bf16 * w.embed_bytes
        if w.quantization is not None:  # what the ranks allocate, by the runtime's rule
            # lazy: torch, to build the stage on the meta device; a plan without --quantization never imports it
            from atoll.planner.quantized import stage_weight_bytes

            weights = stage_weight_bytes(config, layout, i, w)
        kv = per_dp * w.context * (end - start) * s.kv_bytes_per_token_layer(l.tp, w.kv_bytes, w.kv_scale_bytes)
        if cp > 1:
            kv = kv / cp  # the runtime splits a sequence's blocks evenly (context.py)
        kv += static_scale_bytes(config, l.tp, end - start, w.kv_dtype)  # fp8's fixed scales, a few KiB
        if worst is None or weights + kv > worst[0] + worst[1]:
            worst = (weights, kv)
    chunk = min(eff.prefill_chunk_tokens(topology.gpu), per_dp * w.isl)
    inter = max(config.intermediate_size / l.tp if config.intermediate_size else 0,
                s.top_k * config.moe_intermediate_size / l.moe_tp if config.is_moe else 0)
    # residual, normed input, attention output, a scratch copy, the MLP's gate and up (bf16)
    if cp > 1:
        chunk = chunk / cp  # a chunk's tokens split over the cp ranks
    activations = chunk * (4 * s.hidden + 2 * inter) * w.act_bytes
    groups = sum(1 for size in (l.tp, l.dp, l.pp, l.ep, cp) if size > 1)
    buffers = groups * eff.NCCL_BUFFER_BYTES
    if cp > 1:  # a prefill step's gathered queries and every rank's partials of them, one layer at a time
        full = chunk * cp
        buffers += full * (query_bytes_per_token(s, l.tp, w.act_bytes) + 2 * partial_bytes_per_token(s, l.tp))
    if l.ep > 1 and l.dp > 1:  # all-to-all receive buffers for one chunk of dispatched tokens
        buffers += chunk * min(s.top_k, l.ep) * s.hidden * 2
    return MemoryFit(weights=worst[0], kv_cache=worst[1], activations=activations, buffers=buffers,
                     reserve=eff.RESERVE_BYTES, capacity=topology.gpu.memory_bytes)


GIB = 2**30


def kv_token_bytes(fit: MemoryFit, workload) -> float:
    """One token's KV bytes on the worst GPU, from a memory_fit of one request (its KV over its context)."""
    return fit.kv_cache / workload.context


def device_kv_blocks(fit: MemoryFit, topology, workload, *, utilization: float, block_size: int) -> int:
    """KV blocks per DP replica that utilization x the GPU's memory leaves on the worst GPU once
    the weights, activations, buffers and reserve of `fit` (one request's) are counted."""
    free = topology.gpu.memory_bytes * utilization - (fit.weights + fit.activations + fit.buffers + fit.reserve)
    per_token = kv_token_bytes(fit, workload)
    if per_token <= 0:
        return 1 << 30
    return max(0, math.floor(free / (per_token * block_size)))


def tier_blocks(gib: float, block_bytes: float) -> int | None:
    """Blocks a tier of `gib` GiB per rank holds, each a record of a rank's `block_bytes` and the
    record header; None for an unbounded tier (gib inf)."""
    if math.isinf(gib):
        return None
    return max(0, math.floor(gib * GIB / (block_bytes + HEADER.size)))


@dataclass(frozen=True)
class KvCapacity:
    """Blocks of prefix one replica keeps: its device pool and each KV cache tier below it."""
    block_size: int
    block_bytes: float  # one rank's bytes of a block (the worst stage's)
    device_blocks: int
    host_blocks: int = 0
    disk_blocks: int | None = 0  # None: unbounded
    shared: bool = False  # a store every replica shares, unbounded

    def tokens(self) -> dict:
        """Tokens each level holds (None: unbounded); only the tiers there are."""
        out = {"device": self.device_blocks * self.block_size}
        if self.host_blocks:
            out["host"] = self.host_blocks * self.block_size
        if self.disk_blocks != 0:
            out["disk"] = None if self.disk_blocks is None else self.disk_blocks * self.block_size
        if self.shared:
            out["shared"] = None
        return out

    def describe(self) -> str:
        words = {"device": "device pool", "host": "host tier", "disk": "disk tier", "shared": "shared store"}
        return ", ".join(f"{words[k]} {'unbounded' if v is None else f'{v:,} tokens'}"
                         for k, v in self.tokens().items())


def kv_capacity(fit: MemoryFit, workload, *, device_blocks: int, block_size: int, host_gib: float = 0.0,
                disk_gib: float = 0.0, shared: bool = False) -> KvCapacity:
    """The capacity of a replica whose worst GPU's one-request fit is `fit` (module docstring)."""
    block = kv_token_bytes(fit, workload) * block_size
    return KvCapacity(block_size, block, device_blocks, tier_blocks(host_gib, block) if host_gib else 0,
                      tier_blocks(disk_gib, block) if disk_gib else 0, shared)
