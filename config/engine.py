"""EngineConfig: every engine option and behaviour switch, one default each."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from atoll.config.faults import FaultInjection
from atoll.config.speculative import SpeculativeConfig
from atoll.errors import InputError

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cuda", "cpu")
DISPATCH = ("auto", "flat", "hierarchical")  # MoE token dispatch
KERNEL_MODES = ("auto", "torch", "triton")
MOE_EXCHANGES = ("auto", "alltoall", "gather")
COMPILE_POLICIES = ("auto", "always", "never")  # the compiled decode step (engine/step/policy.py)
# KV cache storage (vLLM's spelling; layers/kv_quant.py): auto keeps the compute dtype; fp8 is fp8_e4m3
KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
# each quantized storage's (bytes per value, scale bytes per token and kv head): the sizing of the
# cache (engine/kv/sizing.py, the planner) reads it without torch; layers/kv_quant.py checks its formats agree
KV_STORAGE = {"fp8": (1, 0), "fp8_e4m3": (1, 0), "fp8_e5m2": (1, 0), "int8": (1, 4)}
# weight quantization (vLLM's --quantization): int8 = weight-only int8 per output row on the CPU
# (layers/quant_linear.py); fp8 = float8 e4m3 weights in 128 x 128 blocks (layers/fp8_linear.py)
QUANTIZATIONS = ("int8", "fp8")
# The rows per ep rank up to which the MoE layer gathers every rank's rows instead of the
# all-to-all (layers/moe.py; the planner costs the same threshold). Measured on the 2-core
# CPU over gloo, eager, EP2, all-to-all time over gather time (> 1: gather faster; the
# replicated rows and the 64-row column over 60):
#   python -m atoll bench exchange --hidden 256 --inter 128 --iters 100 [--replicated]
#   rows per rank            1     4     8    16    32    64
#   own rows, hidden 256   1.21  1.08  1.12  1.35  1.48  2.24
#   own rows, hidden 64    1.13  1.25  1.12  1.15  1.13  1.07
#   replicated, hidden 256 0.62  0.53  0.61  0.68  0.77  1.33
#   replicated, hidden 64  0.47  0.47  0.46  0.52  0.55  0.61
# Replicated tokens: one all_reduce against the count exchange, two all_to_alls and a gather
# back. Own rows: 1.1-1.25x to 8 rows over gloo (its reduce_scatter is a whole all_reduce;
# eager also pays a count exchange to agree), beyond that the experts' dense work on ep x rows
# rows grows. 8 takes the clear win and stays near even where it loses; the compiled step
# gathers at any size. Re-measure on NCCL, where the all_to_all's host sync costs more.
MOE_GATHER_MAX_ROWS = 8


# Chunked prefill: a step computes at most this many tokens, so a long prompt is split into
# chunks that ride beside the running sequences' decode tokens instead of stalling them for its
# whole prefill. vLLM's defaults for online serving (vllm/engine/arg_utils.py): 8192 on GPUs of
# 70 GiB or more, 2048 on smaller ones; the CPU takes the smaller. The planner charges the same
# budget for the GPU it plans for (planner/efficiency.py).
LARGE_DEVICE_GIB = 70
BATCHED_TOKENS_LARGE, BATCHED_TOKENS_SMALL = 8192, 2048


def default_batched_tokens(device_memory_gib: float | None = None) -> int:
    """The step's token budget on a device of this much memory (None: a CPU)."""
    large = device_memory_gib is not None and device_memory_gib >= LARGE_DEVICE_GIB
    return BATCHED_TOKENS_LARGE if large else BATCHED_TOKENS_SMALL


def _opt(default, help: str, *, choices=None, cli: bool = True):
    return field(default=default, metadata={"help": help, "choices": choices, "cli": cli})


def default_cache_dir() -> Path:
    return Path("~/.cache/atoll").expanduser()


@dataclass(frozen=True)
class EngineConfig:
    device: str = _opt("auto", "auto: CUDA when every rank sees a GPU, else CPU", choices=DEVICES)
    dtype: str | None = _opt(None, "compute dtype (default: the checkpoint's torch_dtype on CUDA, "
                                   "float32 on CPU)", choices=DTYPES)
    max_num_seqs: int = _opt(32, "sequences per micro-batch (under PP, pp micro-batches are in flight)")
    max_model_len: int | None = _opt(None, "context length (default: the model's)")
    max_num_batched_tokens: int | None = _opt(None, "tokens a step computes, prompts chunked to fit beside the "
                                                    "decoding sequences (default: 8192 on GPUs of 70 GiB or more, "
                                                    "else 2048)")
    block_size: int = _opt(16, "tokens per KV cache block")
    kv_cache_dtype: str = _opt("auto", "KV cache storage: auto (the compute dtype), fp8 (= fp8_e4m3: a scale per "
                                       "layer and kv head, and a sink for the first token: see --kv-scales), fp8_e5m2 (no "
                                       "scale), int8 (a float32 scale per token and kv head); layers/kv_quant.py",
                               choices=KV_CACHE_DTYPES)
    kv_scales: str | None = _opt(None, "fp8 KV cache: read its scales from this file (atoll calibrate-kv's); "
                                       "default: the checkpoint's k_scale/v_scale, else atoll-kv-scales.json beside "
                                       "it, else 1 (vLLM's default) (models/kv_scales.py)")
    calculate_kv_scales: bool = _opt(False, "fp8 KV cache: fit each layer's scales on the first prefill, as vLLM's "
                                            "flag (they then depend on that prompt: atoll calibrate-kv fits them once "
                                            "from a text)")
    quantization: str | None = _opt(None, "weights: int8 (int8 rows with a bf16 scale each, CPU; "
                                          "layers/quant_linear.py) or fp8 (e4m3 in 128 x 128 blocks with a float32 "
                                          "scale each; layers/fp8_linear.py); default: the checkpoint's",
                                    choices=QUANTIZATIONS)
    kv_cache_gb: float | None = _opt(None, "KV cache per rank in GiB (default: CUDA, from "
                                           "--gpu-memory-utilization; CPU, what the requests need)")
    num_blocks: int | None = _opt(None, "KV cache blocks per rank (instead of --kv-cache-gb)")
    kv_offload_gb: float = _opt(0.0, "KV cache tiers: GiB of host memory per rank holding prefix blocks below the "
                                     "device pool (engine/rank/kv_tiers.py)")
    kv_disk_dir: str | None = _opt(None, "KV cache tiers: a directory on local disk holding prefix blocks (empty or "
                                         "atoll's own; a restart on it starts warm)")
    kv_disk_gb: float | None = _opt(None, "KV cache tiers: GiB the --kv-disk-dir holds at most per rank (default: "
                                          "until the disk is full)")
    kv_shared: str | None = _opt(None, "KV cache tiers: a store every replica and restart shares, file:///DIR or "
                                       "redis://HOST:PORT")
    gpu_memory_utilization: float = _opt(0.9, "share of each GPU's memory for weights, activations "
                                              "and KV cache")
    enforce_eager: bool = _opt(False, "run the decode step eagerly: no torch.compile, no CUDA graphs "
                                      "(env ATOLL_ENFORCE_EAGER)")
    compile: str = _opt("auto", "the compiled decode step (inductor on CPU, CUDA graphs on GPU): auto compiles "
                                "when the run's decode steps repay the compile time recorded (or estimated) on this "
                                "machine, always compiles at once, never does not (the eager step keeps the "
                                "products tuned for this CPU; --enforce-eager runs plain ones) (env ATOLL_COMPILE)",
                        choices=COMPILE_POLICIES)
    compile_freezing: bool = _opt(True, "CPU: pack the linear weights for oneDNN (a second copy, made when it "
                                        "fits): all of them for the compiled step, and for the eager step those "
                                        "whose packed product measures faster here (not with --enforce-eager) "
                                        "(env ATOLL_COMPILE_FREEZING)")
    enable_prefix_caching: bool = _opt(True, "reuse the KV blocks of prompt prefixes already computed "
                                             "(engine.kv.blocks)")
    disable_hybrid_kv_cache_manager: bool = _opt(False, "a model whose sliding-window layers sit beside "
                                                        "full-attention ones keeps one block table for all "
                                                        "layers, every block kept (default: the sliding layers "
                                                        "keep their own cache and let go of the blocks their "
                                                        "window has passed; engine.kv.windowed)")
    prefill: str | None = _opt(None, "disaggregated prefill: the prefill engine's layout (e.g. TP2), beside "
                                     "--decode; the job runs both engines (engine.disagg.roles)")
    decode: str | None = _opt(None, "disaggregated prefill: the decode engine's layout (e.g. TP4), beside --prefill")
    disagg_min_prompt_tokens: int = _opt(0, "with --prefill/--decode, prompts whose uncached part is shorter "
                                            "than this are prefilled by the decode engine itself")
    disagg_max_prefill_queue: int | None = _opt(None, "with --prefill/--decode, a prompt goes to the prefill "
                                                      "engines only while fewer than this many requests wait there "
                                                      "for their first token (all of them together); past it the "
                                                      "decode engine prefills it (default: no limit)")
    prefill_replicas: int = _opt(1, "with --prefill/--decode (a living engine): prefill engines of the --prefill "
                                    "layout (xPyD)")
    decode_replicas: int = _opt(1, "with --prefill/--decode (a living engine): decode engines of the --decode "
                                   "layout (xPyD)")
    colocated_replicas: int = _opt(0, "with --prefill/--decode: the last N of the decode engines prefill every "
                                      "prompt themselves and take no hand-off, colocated replicas beside the xPyD "
                                      "ones (1P1D plus 2 colocated: --prefill-replicas 1 --decode-replicas 3 "
                                      "--colocated-replicas 2)")
    dispatch: str = _opt("auto", "MoE token dispatch: auto (island-first when an EP group spans islands, "
                                 "else flat), flat or hierarchical", choices=DISPATCH)
    moe_capacity_factor: float | None = _opt(None, "each expert keeps at most this factor x its even share "
                                                   "of a step's (token, expert) pairs (default: dropless)")
    moe_exchange: str = _opt("auto", "MoE exchange over the ep group: auto (gather up to --moe-gather-rows "
                                     "rows per rank, else all-to-all), alltoall or gather (env ATOLL_MOE_EXCHANGE)",
                             choices=MOE_EXCHANGES)
    moe_gather_rows: int = _opt(MOE_GATHER_MAX_ROWS, "rows per ep rank up to which auto gathers "
                                                     "(env ATOLL_MOE_GATHER_ROWS)")
    # expert load balancing (EPLB), spelled as vLLM's flags; comm/eplb.py, engine/rank/eplb.py
    enable_eplb: bool = _opt(False, "MoE: balance the experts' load over the EP ranks: every --eplb-step-interval "
                                    "steps, place the experts and --num-redundant-experts copies of the hottest "
                                    "from the tokens counted over the last --eplb-window-size steps, the weights "
                                    "moved between ranks in the background, a layer a step")
    num_redundant_experts: int = _opt(0, "MoE with --enable-eplb: physical expert slots beyond the logical experts "
                                         "(E + R slots over the EP ranks), each a copy of a hot expert")
    eplb_window_size: int = _opt(1000, "MoE: the steps whose expert loads are counted (a sliding window: the "
                                       "rebalance's input and the reported load)")
    eplb_step_interval: int = _opt(3000, "MoE with --enable-eplb: steps between two rebalances")
    eplb_async: bool = _opt(True, "MoE with --enable-eplb: move the layers one a step, each copied in the background "
                                  "while a step runs (--no-eplb-async: every layer at the rebalance's step boundary, "
                                  "the engine waiting)")
    elastic_ep: bool = _opt(False, "MoE, a DPnEPn layout with --enable-eplb and --num-redundant-experts R >= 1, "
                                   "local launcher: when a rank dies (rank 0 included), the others go on at DP(n-1)EP(n-1), "
                                   "its experts served from the copies left or read again from the checkpoint, its "
                                   "requests continued with their tokens (docs/eplb.md)")
    expert_load_interval: int = _opt(100, "MoE: every this many steps, each layer's max/mean tokens per EP rank over "
                                          "the window goes into the engine's stats (/metrics); 0: only at the end "
                                          "of a run (atoll generate --stats)")
    # two-batch overlap (TBO), spelled as SGLang's flag; engine/step/two_batch.py
    enable_two_batch_overlap: bool = _opt(False, "MoE: run a step of at least --tbo-token-threshold tokens as two "
                                                 "micro-batches, each one's dispatch and combine all-to-all "
                                                 "flying while the other computes")
    tbo_token_threshold: int = _opt(256, "MoE with --enable-two-batch-overlap: the fewest tokens in a step (the "
                                         "most any DP replica has) that split it in two; below, one batch")
    kernels: str = _opt("auto", "auto: Triton kernels on CUDA, torch elsewhere; torch or triton force one "
                                "(env ATOLL_KERNELS)", choices=KERNEL_MODES)
    mkl_pack: bool = _opt(False, "eager CPU decode: pack linear weights for MKL at the decode batch size "
                                 "(env ATOLL_MKL_PACK)")
    collective_timeout_s: float = _opt(120.0, "seconds a collective may wait for a peer before the job fails "
                                              "(env ATOLL_COLLECTIVE_TIMEOUT_S)")
    speculative_config: SpeculativeConfig | None = _opt(None, "speculative decoding, as vLLM's JSON: "
                                                             "{\"method\": \"ngram\" or \"layer_skip\", "
                                                             "\"num_speculative_tokens\": K, ...} "
                                                             "(config/speculative.py)")
    step_trace: str | None = _opt(None, "append every engine tick's shape (decode rows, prompt-chunk tokens, the "
                                        "positions they attend to) and seconds to this file, a JSON line each, from "
                                        "each engine's first rank (atoll calibrate --steps reads them)")
    fault_injection: FaultInjection | None = _opt(None, "off unless given: faults caused on purpose, for tests and "
                                                        "benchmarks, e.g. kill:rank=1:step=40, "
                                                        "delay:rank=1:ms=200:step=10, drop:rank=1:step=5, joined "
                                                        "by commas (config/faults.py)")
    stall_timeout_s: float | None = _opt(None, "a living engine whose ranks send no step for this many seconds "
                                               "while requests run is marked failed (a rank slow or stopped; "
                                               "the server restarts it); default off")
    heartbeat_timeout_s: float = _opt(10.0, "a rank whose heartbeat is this many seconds late is taken as "
                                            "stopped: its engine is drained, its requests migrate and it is "
                                            "restarted (the local launcher's heartbeat)")
    slow_step_ratio: float | None = _opt(None, "with replicas: a replica whose median step over the last "
                                               "--slow-step-window steps is this many times its peers' median "
                                               "is drained and restarted (a slow rank, before it fails); "
                                               "default off")
    slow_step_window: int = _opt(16, "the steps --slow-step-ratio looks at, per replica")
    gpu_health_xids: str = _opt("48,63,64,74,79,92,94,95", "on GPUs (serve, local ranks): a replica whose GPU "
                                "reports one of these Xids (NVML's critical Xid events) is drained and restarted; "
                                "'' reads none (needs nvidia-ml-py; serve/gpu_health.py)")
    gpu_health_ecc_limit: int | None = _opt(0, "on GPUs (serve, local ranks): the uncorrected ECC errors a GPU "
                                               "may add while its replica serves before it is drained and "
                                               "restarted (NVML's volatile count; default 0: the first does)")
    cache_dir: str | None = _opt(None, "where atoll keeps converted models, compiled graphs (inductor/) and "
                                       "compile times (decode_steps.json) (default ~/.cache/atoll; env ATOLL_CACHE)")

    def __post_init__(self):
        if self.speculative_config is not None:  # JSON text (the CLI's), a dict or a SpeculativeConfig
            object.__setattr__(self, "speculative_config", SpeculativeConfig.parse(self.speculative_config))
        object.__setattr__(self, "fault_injection", FaultInjection.parse(self.fault_injection))
        for name, choices in (("device", DEVICES), ("dispatch", DISPATCH), ("kernels", KERNEL_MODES),
                              ("moe_exchange", MOE_EXCHANGES), ("compile", COMPILE_POLICIES),
                              ("kv_cache_dtype", KV_CACHE_DTYPES)):
            if getattr(self, name) not in choices:
                raise InputError(f"{name} {getattr(self, name)!r} is not one of {', '.join(choices)}")
        spec = self.speculative_config
        if spec is not None and spec.topk > 1 and self.kv_cache_dtype != "auto":
            raise InputError(f"speculative topk={spec.topk} (tree drafts) keeps its KV unquantized for now: "
                             f"not with kv_cache_dtype {self.kv_cache_dtype}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise InputError(f"quantization {self.quantization!r} is not one of {', '.join(QUANTIZATIONS)}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InputError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        for name in ("max_num_seqs", "block_size", "max_model_len", "max_num_batched_tokens", "num_blocks",
                     "moe_gather_rows", "slow_step_window"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InputError(f"{name}={value!r} must be a whole number of at least 1")
        self._check_eplb()
        self._check_gpu_health()
        r = self.slow_step_ratio
        if r is not None and (isinstance(r, bool) or not isinstance(r, (int, float)) or not r > 1):
            raise InputError(f"slow_step_ratio={r!r} must be a number above 1 (a step this many times its peers')")
        for name in ("kv_cache_gb", "moe_capacity_factor", "collective_timeout_s", "kv_disk_gb", "stall_timeout_s",
                     "heartbeat_timeout_s"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                                      or not value > 0):
                raise InputError(f"{name}={value!r} must be a positive number")
        v = self.kv_offload_gb
        if isinstance(v, bool) or not isinstance(v, (int, float)) or v < 0:
            raise InputError(f"kv_offload_gb={v!r} must be a number of at least 0")
        if self.kv_disk_gb is not None and not self.kv_disk_dir:
            raise InputError("--kv-disk-gb needs --kv-disk-dir")
        if self.kv_shared is not None and not str(self.kv_shared).startswith(("file://", "redis://")):
            raise InputError(f"kv_shared={self.kv_shared!r} must be file:///DIR or redis://HOST:PORT")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InputError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        for name in ("enforce_eager", "compile_freezing", "enable_prefix_caching", "mkl_pack",
                     "disable_hybrid_kv_cache_manager", "calculate_kv_scales"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name}={getattr(self, name)!r} must be True or False")
        if (self.prefill is None) != (self.decode is None):
            raise InputError("give --prefill and --decode together (the two engines' layouts)")
        m = self.disagg_min_prompt_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise InputError(f"disagg_min_prompt_tokens={m!r} must be a whole number of at least 0")
        for name in ("prefill_replicas", "decode_replicas", "disagg_max_prefill_queue"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InputError(f"{name}={value!r} must be a whole number of at least 1")
        if self.prefill is None and (self.prefill_replicas, self.decode_replicas) != (1, 1):
            raise InputError("--prefill-replicas/--decode-replicas need --prefill and --decode")
        c = self.colocated_replicas
        if isinstance(c, bool) or not isinstance(c, int) or c < 0:
            raise InputError(f"colocated_replicas={c!r} must be a whole number of at least 0")
        if c and self.prefill is None:
            raise InputError("--colocated-replicas needs --prefill and --decode")
        if c and c >= self.decode_replicas:
            raise InputError(f"--colocated-replicas {c} must leave a decode engine that takes the prefill engines' "
                             f"hand-offs: it must be under --decode-replicas {self.decode_replicas}")
        self._check_kv_scales()

    def _check_kv_scales(self) -> None:
        """The fp8 KV scales' sources (models/kv_scales.py): one at a time, fp8 e4m3 only, and a
        fit on the first prefill only where no other engine or run reads the blocks it makes."""
        wanted = "--kv-scales" if self.kv_scales is not None else \
            "--calculate-kv-scales" if self.calculate_kv_scales else None
        if wanted is None:
            return
        if self.kv_scales is not None:
            object.__setattr__(self, "kv_scales", str(Path(self.kv_scales).expanduser().resolve()))
            if not Path(self.kv_scales).is_file():
                raise InputError(f"--kv-scales {self.kv_scales}: no such file")
        if self.kv_scales is not None and self.calculate_kv_scales:
            raise InputError("give --kv-scales or --calculate-kv-scales, not both")
        if self.kv_cache_dtype not in ("fp8", "fp8_e4m3"):
            raise InputError(f"{wanted} sets fp8 e4m3's scales: it needs --kv-cache-dtype fp8, not "
                             f"{self.kv_cache_dtype} (fp8_e5m2 and int8 keep no fixed scale)")
        if self.calculate_kv_scales and self.prefill is not None:
            raise InputError("--calculate-kv-scales with --prefill/--decode: the decode engine would read the prefill "
                             "engine's KV under scales of its own; fit them once with atoll calibrate-kv, which "
                             "both engines read")
        if self.calculate_kv_scales and (self.kv_disk_dir or self.kv_shared):
            raise InputError("--calculate-kv-scales with --kv-disk-dir/--kv-shared: another run, fitting other "
                             "scales on its first prefill, would read these blocks; fit them once with atoll "
                             "calibrate-kv")

    def _check_eplb(self) -> None:
        """The EPLB flags: whole numbers, and redundant experts only with --enable-eplb (as vLLM)."""
        for name, least in (("num_redundant_experts", 0), ("eplb_window_size", 1), ("eplb_step_interval", 1),
                            ("expert_load_interval", 0)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise InputError(f"{name}={value!r} must be a whole number of at least {least}")
        if isinstance(self.tbo_token_threshold, bool) or not isinstance(self.tbo_token_threshold, int) \
                or self.tbo_token_threshold < 2:
            raise InputError(f"tbo_token_threshold={self.tbo_token_threshold!r} must be a whole number of at least 2")
        for name in ("enable_eplb", "eplb_async", "enable_two_batch_overlap", "elastic_ep"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name}={getattr(self, name)!r} must be True or False")
        if self.num_redundant_experts and not self.enable_eplb:
            raise InputError(f"--num-redundant-experts {self.num_redundant_experts} needs --enable-eplb")

    def _check_gpu_health(self) -> None:
        text = self.gpu_health_xids
        parts = [x.strip() for x in str(text).split(",") if x.strip()] if text is not None else []
        if not isinstance(text, str) or not all(p.isdigit() for p in parts):
            raise InputError(f"gpu_health_xids={text!r} must be Xid numbers joined by commas (e.g. 48,79), or ''")
        v = self.gpu_health_ecc_limit
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise InputError(f"gpu_health_ecc_limit={v!r} must be a whole number of at least 0")

    def batched_tokens(self, device_memory_gib: float | None = None) -> int:
        """Tokens a step computes: max_num_batched_tokens, else default_batched_tokens."""
        return self.max_num_batched_tokens or default_batched_tokens(device_memory_gib)

    @property
    def cache_path(self) -> Path:
        """cache_dir expanded, or the default."""
        return Path(self.cache_dir).expanduser() if self.cache_dir else default_cache_dir()
