"""A deployment to simulate: replicas of one layout behind the router, or xPyD disaggregation
(X prefill engines of one layout, Y decode engines of another), with the engine options that
shape its steps (max_num_seqs, the chunk budget, the block size, prefix caching, the KV dtype,
speculation) and the KV capacity each engine gets.

KV capacity: on a CPU machine what the runtime allocates there (engine.kv.sizing.cpu_blocks:
max_num_seqs sequences of max_model_len per lane); on GPUs what the planner's memory model
leaves of gpu_memory_utilization x the GPU's memory once the weights, activations, buffers
and reserve are counted (planner/memory.py), in blocks of the runtime's size. --num-blocks
overrides both.

KV cache tiers (engine/kv/tiers, as `atoll serve` takes them): kv_offload_gb GiB of host memory
per rank, kv_disk_gb GiB of disk per rank (inf: as much as the disk holds), kv_shared a store
every replica shares, unbounded. Each engine kind's capacity in blocks (planner/memory.py) and
its tiers' speeds (planner/tiers.py) go to the simulated tiers (tiers.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from atoll.config.engine import default_batched_tokens
from atoll.config.speculative import SpeculativeConfig
from atoll.engine.batch.router import ROUTERS
from atoll.engine.kv.sizing import cpu_blocks
from atoll.errors import ConfigError, InputError
from atoll.parallel.layout import Layout, resolve_layout
from atoll.parallel.placement import Placement
from atoll.planner.cost import CostModel
from atoll.planner.memory import KvCapacity, device_kv_blocks, kv_capacity, memory_fit
from atoll.planner.shapes import shapes as model_shapes
from atoll.planner.sim.clock import StepCost
from atoll.planner.sim.stepfit import StepFit
from atoll.planner.tiers import tier_speeds
from atoll.planner.workload import Workload

RUNTIME_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "bf16"}  # the runtime's names -> the planner's


@dataclass(frozen=True)
class Deployment:
    layout: str = "TP1"  # each replica's layout (colocated)
    replicas: int = 1
    prefill: str | None = None  # xPyD: the prefill engines' layout ...
    decode: str | None = None  # ... and the decode engines'
    prefill_replicas: int = 1
    decode_replicas: int = 1
    router: str = "cache_aware"
    max_num_seqs: int = 32
    max_num_batched_tokens: int | None = None  # None: the runtime's default for the device
    block_size: int = 16
    max_model_len: int | None = None  # None: the model's
    prefix_caching: bool = False
    dtype: str = "auto"  # the weights' precision (planner Workload names)
    kv_dtype: str = "auto"
    num_blocks: int | None = None  # per engine replica; None: sized as the runtime would
    gpu_memory_utilization: float = 0.9
    spec_tokens: int = 0  # speculative tokens a decode step drafts (0: off)
    acceptance: float = 0.0  # the chance each drafted token is kept
    draft_rate: float = 1.0  # the share of decode steps that get a draft
    min_prompt_tokens: int = 0  # disaggregation: shorter uncached prompts stay on the decode engine
    max_prefill_queue: int | None = None
    colocated_replicas: int = 0  # the last N decode engines prefill every prompt themselves (--colocated-replicas)
    kv_offload_gb: float = 0.0  # KV cache tiers: GiB of host memory per rank (--kv-offload-gb)
    kv_disk_gb: float = 0.0  # GiB of disk per rank (--kv-disk-gb; inf: unbounded)
    kv_shared: bool = False  # a store every replica shares, unbounded (--kv-shared)

    def __post_init__(self):
        for name in ("replicas", "prefill_replicas", "decode_replicas", "max_num_seqs", "block_size"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 20:
                raise ConfigError(f"{name}={v!r} must be a whole number from 1 to {1 << 20}")
        for name in ("max_num_batched_tokens", "max_model_len", "num_blocks", "max_prefill_queue"):
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or not 1 <= v <= 1 << 40):
                raise ConfigError(f"{name}={v!r} must be a whole number from 1 to {1 << 40}")
        if self.router not in ROUTERS:
            raise ConfigError(f"router {self.router!r}: choose one of {', '.join(ROUTERS)}")
        if (self.prefill is None) != (self.decode is None):
            raise ConfigError("disaggregation takes both a prefill and a decode layout")
        c = self.colocated_replicas
        most = self.decode_replicas if self.prefill else 1
        if isinstance(c, bool) or not isinstance(c, int) or not 0 <= c < most:
            raise ConfigError(f"colocated_replicas={c!r} must be a whole number under the decode engines' count "
                              "(one takes the hand-offs), and 0 without disaggregation")
        if not 0 <= self.acceptance <= 1 or not 0 <= self.draft_rate <= 1:
            raise ConfigError(f"acceptance {self.acceptance} and draft rate {self.draft_rate} must lie in [0, 1]")
        if isinstance(self.spec_tokens, bool) or not isinstance(self.spec_tokens, int) or not 0 <= self.spec_tokens <= 64:
            raise ConfigError(f"spec_tokens={self.spec_tokens!r} must be a whole number from 0 to 64")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ConfigError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        for name in ("kv_offload_gb", "kv_disk_gb"):  # kv_disk_gb inf: a disk as large as it needs
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not v >= 0:
                raise ConfigError(f"{name}={v!r} must be a number of GiB of at least 0")
        if math.isinf(self.kv_offload_gb):
            raise ConfigError("kv_offload_gb=inf: host memory is not unbounded")
        if not isinstance(self.kv_shared, bool):
            raise ConfigError(f"kv_shared={self.kv_shared!r} must be true or false")
        if self.tiered and not self.prefix_caching:
            raise ConfigError("KV cache tiers hold prefix blocks: they need prefix caching (drop "
                              "--no-enable-prefix-caching)")

    @property
    def tiered(self) -> bool:
        """Whether the engines have KV cache tiers below their pools."""
        return bool(self.kv_offload_gb or self.kv_disk_gb or self.kv_shared)

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    def describe(self) -> str:
        if self.disaggregated:
            return f"{self.prefill_replicas}P{self.decode_replicas}D ({self.prefill} prefill, {self.decode} decode)"
        return f"{self.replicas} x {self.layout}"

    @property
    def gpus_per_engine(self) -> list[int]:
        if self.disaggregated:
            p, d = Layout.parse(self.prefill).world_size, Layout.parse(self.decode).world_size
            return [p] * self.prefill_replicas + [d] * self.decode_replicas
        return [Layout.parse(self.layout).world_size] * self.replicas


@dataclass
class EngineKind:
    """What every engine of one layout shares: its cost, KV capacity and options."""
    layout: Layout
    cost_model: CostModel
    num_blocks: int  # per DP replica
    max_num_batched_tokens: int
    max_model_len: int
    fit: StepFit | None = None  # the model's measured steps at this layout on this machine
    capacity: KvCapacity | None = None  # per DP replica: the device pool's blocks and the tiers' below
    speeds: dict | None = None  # the tiers' speeds per rank (planner/tiers.py), with tiers

    def step_cost(self) -> StepCost:
        return StepCost(self.cost_model, self.fit)


def on_cpu(topology) -> bool:
    cal = topology.calibration
    return (cal is not None and cal.device == "cpu") or topology.gpu.name.startswith("cpu")


def engine_kind(config, topology, deployment: Deployment, layout_text: str, *, isl: float, osl: float,
                ranks: int | None = None, model_name: str | None = None) -> EngineKind:
    """One engine layout's cost model and KV capacity for requests of mean isl in, osl out;
    ranks: the deployment's ranks busy on one node (on a calibrated CPU they share its cores)."""
    d = deployment
    layout = Layout.parse(layout_text).validate(config)
    if layout.world_size > topology.num_gpus:
        raise ConfigError(f"{layout} takes {layout.world_size} GPUs; {topology.name} has {topology.num_gpus}")
    max_len = min(d.max_model_len or config.max_position_embeddings, config.max_position_embeddings)
    work = Workload(isl=max(1, round(isl)), osl=max(1, round(osl)), concurrency=d.max_num_seqs, dtype=d.dtype,
                    kv_dtype=d.kv_dtype)
    if work.context > config.max_position_embeddings:
        work = replace(work, isl=max(1, config.max_position_embeddings - work.osl))
    work = work.resolved(config)
    sh = model_shapes(config)
    placement = Placement.build(layout, topology, allow_cross_island=True)
    cm = CostModel(config, sh, topology, work, layout, placement,
                   ranks=min(topology.gpus_per_node, ranks or layout.world_size))
    cpu = on_cpu(topology)
    budget = d.max_num_batched_tokens or default_batched_tokens(None if cpu else topology.gpu.memory_gib)
    if d.num_blocks is not None:
        blocks = d.num_blocks
    elif cpu:
        blocks = cpu_blocks(block_size=d.block_size, max_num_seqs=d.max_num_seqs, max_model_len=max_len,
                            lanes=layout.pp, cp=layout.cp)
    else:
        blocks = gpu_blocks(config, sh, topology, work, layout, d)
    one = memory_fit(config, sh, topology, work, layout, 1)
    if blocks < 1:
        raise ConfigError(f"{layout} on {topology.name}: no memory left for a KV cache after the weights "
                          f"({one.describe()})")
    if d.tiered and layout.cp > 1:
        raise ConfigError("KV cache tiers run with TP, PP and DP replicas; not yet with context parallel stripes")
    capacity = kv_capacity(one, work, device_blocks=blocks, block_size=d.block_size, host_gib=d.kv_offload_gb,
                           disk_gib=d.kv_disk_gb, shared=d.kv_shared)
    speeds = tier_speeds(topology, cpu=cpu, ranks_on_node=min(topology.gpus_per_node, ranks or layout.world_size)) \
        if d.tiered else None
    fit = None
    cal = topology.calibration
    fits = cal.steps.get(model_name, {}) if cal is not None else {}
    copies = max(1, (ranks or layout.world_size) // layout.world_size)  # engines of this size sharing the node
    for key in ([f"{copies} x {layout}"] if copies > 1 else []) + [str(layout)]:
        if key in fits:
            fit = StepFit.from_dict(fits[key], f"calibration.steps.{model_name}.{key}")
            break
    return EngineKind(layout, cm, blocks, budget, max_len, fit, capacity, speeds)


def gpu_blocks(config, shapes, topology, workload, layout, d: Deployment) -> int:
    """KV blocks per DP replica the memory model leaves on the worst GPU."""
    fit = memory_fit(config, shapes, topology, workload, layout, 1)
    return device_kv_blocks(fit, topology, workload, utilization=d.gpu_memory_utilization, block_size=d.block_size)


def from_engine_flags(args, config, topology, *, replicas: int | None = None, router: str = "cache_aware",
                      acceptance: float | None = None, draft_rate: float = 1.0) -> Deployment:
    """The deployment `atoll serve`'s engine flags describe (config.add_model_options), a dense
    model's dp as replicas as atoll serve takes it; acceptance: a drafted token's chance to be kept,
    needed with --speculative-config."""
    disagg = args.prefill is not None or args.decode is not None
    layout = resolve_layout(args.layout, args.tensor_parallel_size, args.pipeline_parallel_size,
                            args.data_parallel_size, args.expert_parallel_size, args.context_parallel_size)
    count = 1 if replicas is None else replicas  # 0 or less: Deployment refuses it in one line
    if not config.is_moe and layout.dp > 1:
        if replicas is not None:
            raise InputError(f"give replicas as --replicas or as the layout's dp ({layout}), not both")
        count, layout = layout.dp, Layout(tp=layout.tp, pp=layout.pp, cp=layout.cp)
    cpu = on_cpu(topology)
    dtype = RUNTIME_DTYPES.get(args.dtype or "", "fp32" if cpu else "auto")
    kv = {"auto": dtype, "fp8": "fp8", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "int8": "int8"}
    spec_k = 0
    if args.speculative_config:
        cfg = args.speculative_config if isinstance(args.speculative_config, SpeculativeConfig) \
            else SpeculativeConfig.parse(args.speculative_config)
        if acceptance is None:
            raise ConfigError("--speculative-config needs --acceptance: the chance a drafted token is kept "
                              "(a server's /metrics give it: atoll_spec_decode_acceptance_rate)")
        spec_k = cfg.k
    offload, disk_gb, disk_dir = args.kv_offload_gb or 0.0, args.kv_disk_gb, args.kv_disk_dir
    for flag, v in (("--kv-offload-gb", offload), ("--kv-disk-gb", disk_gb)):
        if v is not None and not 0 <= v < math.inf:
            raise InputError(f"{flag} {v}: must be a number of GiB of at least 0")
    # a simulation has no directory: --kv-disk-gb alone is a disk tier of that size, --kv-disk-dir
    # alone one as large as the disk (unbounded); --kv-shared (a flag, or the engine's URL) a shared store
    disk = float(disk_gb) if disk_gb else (math.inf if disk_dir else 0.0)
    return Deployment(layout=str(layout), replicas=count, prefill=args.prefill if disagg else None,
                      decode=args.decode if disagg else None, prefill_replicas=args.prefill_replicas,
                      decode_replicas=args.decode_replicas, router=router, max_num_seqs=args.max_num_seqs,
                      max_num_batched_tokens=args.max_num_batched_tokens, block_size=args.block_size,
                      max_model_len=args.max_model_len, prefix_caching=bool(args.enable_prefix_caching),
                      dtype=dtype, kv_dtype=kv.get(args.kv_cache_dtype or "auto", dtype), num_blocks=args.num_blocks,
                      gpu_memory_utilization=args.gpu_memory_utilization, spec_tokens=spec_k, acceptance=acceptance or 0.0,
                      draft_rate=draft_rate, min_prompt_tokens=args.disagg_min_prompt_tokens,
                      max_prefill_queue=args.disagg_max_prefill_queue,
                      colocated_replicas=args.colocated_replicas,
                      kv_offload_gb=float(offload), kv_disk_gb=disk,
                      kv_shared=bool(args.kv_shared))
