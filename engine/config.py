"""EngineConfig: the engine's options, one default each. The CLI flags (`add_cli_options`),
the `LLM(...)` keywords and the per-rank RunSpec are all made from it."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

from atoll.errors import InputError

DTYPES = ("float32", "bfloat16", "float16")
DEVICES = ("auto", "cuda", "cpu")
DISPATCH = ("auto", "flat", "hierarchical")  # MoE token dispatch; parallel.mesh.ContextOptions takes them too


def _opt(default, help: str, *, choices=None, short=None):
    return field(default=default, metadata={"help": help, "choices": choices, "short": short})


@dataclass(frozen=True)
class EngineConfig:
    device: str = _opt("auto", "auto: CUDA when every rank sees a GPU, else CPU", choices=DEVICES)
    dtype: str | None = _opt(None, "compute dtype (default: the checkpoint's torch_dtype on CUDA, "
                                   "float32 on CPU)", choices=DTYPES)
    max_num_seqs: int = _opt(32, "sequences per micro-batch (under PP, pp micro-batches are in flight)")
    max_model_len: int | None = _opt(None, "context length (default: the model's)")
    max_num_batched_tokens: int | None = _opt(None, "tokens per micro-batch (default: max(2048, context))")
    block_size: int = _opt(16, "tokens per KV cache block")
    kv_cache_gb: float | None = _opt(None, "KV cache per rank in GiB (default: CUDA, from "
                                           "--gpu-memory-utilization; CPU, what the requests need)")
    num_blocks: int | None = _opt(None, "KV cache blocks per rank (instead of --kv-cache-gb)")
    gpu_memory_utilization: float = _opt(0.9, "share of each GPU's memory for weights, activations "
                                              "and KV cache")
    enforce_eager: bool = _opt(False, "run the decode step eagerly: no torch.compile, no CUDA graphs")
    enable_prefix_caching: bool = _opt(True, "reuse the KV blocks of prompt prefixes already computed "
                                             "(engine.blocks)")
    prefill: str | None = _opt(None, "disaggregated prefill: the prefill engine's layout (e.g. TP2), beside "
                                     "--decode; the job runs both engines (engine.disagg)")
    decode: str | None = _opt(None, "disaggregated prefill: the decode engine's layout (e.g. TP4), beside --prefill")
    disagg_min_prompt_tokens: int = _opt(0, "with --prefill/--decode, prompts whose uncached part is shorter "
                                            "than this are prefilled by the decode engine itself")
    dispatch: str = _opt("auto", "MoE token dispatch: auto (island-first when an EP group spans islands, "
                                 "else flat), flat or hierarchical", choices=DISPATCH)
    moe_capacity_factor: float | None = _opt(None, "each expert keeps at most this factor x its even share "
                                                   "of a step's (token, expert) pairs (default: dropless)")

    def __post_init__(self):
        if self.device not in DEVICES:
            raise InputError(f"device {self.device!r} is not one of {', '.join(DEVICES)}")
        if self.dtype is not None and self.dtype not in DTYPES:
            raise InputError(f"dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        for name in ("max_num_seqs", "block_size", "max_model_len", "max_num_batched_tokens", "num_blocks"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise InputError(f"{name}={value!r} must be a whole number of at least 1")
        if self.kv_cache_gb is not None and not self.kv_cache_gb > 0:
            raise InputError(f"kv_cache_gb={self.kv_cache_gb} must be positive")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise InputError(f"gpu_memory_utilization={self.gpu_memory_utilization} must be in (0, 1]")
        for name in ("enforce_eager", "enable_prefix_caching"):
            if not isinstance(getattr(self, name), bool):
                raise InputError(f"{name}={getattr(self, name)!r} must be True or False")
        if (self.prefill is None) != (self.decode is None):
            raise InputError("give --prefill and --decode together (the two engines' layouts)")
        m = self.disagg_min_prompt_tokens
        if isinstance(m, bool) or not isinstance(m, int) or m < 0:
            raise InputError(f"disagg_min_prompt_tokens={m!r} must be a whole number of at least 0")
        if self.dispatch not in DISPATCH:
            raise InputError(f"dispatch {self.dispatch!r} is not one of {', '.join(DISPATCH)}")
        if self.moe_capacity_factor is not None and not self.moe_capacity_factor > 0:
            raise InputError(f"moe_capacity_factor={self.moe_capacity_factor} must be positive")


def add_cli_options(parser) -> None:
    """One --flag per EngineConfig field, with its default and help."""
    import argparse

    for f in fields(EngineConfig):
        flag = "--" + f.name.replace("_", "-")
        if str(f.type) == "bool":  # a switch: --flag sets it; one on by default also has --no-flag
            action = argparse.BooleanOptionalAction if f.default else "store_true"
            parser.add_argument(flag, dest=f.name, action=action, default=f.default, help=f.metadata["help"])
            continue
        kind = {"int": int, "float": float}.get(str(f.type).split(" ")[0], str)
        parser.add_argument(flag, dest=f.name, type=kind, default=f.default, choices=f.metadata["choices"],
                            metavar=None if f.metadata["choices"] else f.name.split("_")[-1].upper(),
                            help=f.metadata["help"])


def from_args(args) -> EngineConfig:
    return EngineConfig(**{f.name: getattr(args, f.name) for f in fields(EngineConfig)})
