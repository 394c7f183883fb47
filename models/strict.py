"""Strict loading: what load_weights refuses, each as one CheckpointError line naming the tensor.

- a tensor stored in a dtype atoll cannot read (integers, or fp8 outside an fp8-quantized
  checkpoint; models/fp8_scheme.py), or an fp8 weight whose scales are missing or malformed: `source`, before anything of it is read;
- a parameter no checkpoint tensor filled: `check_filled`;
- a checkpoint tensor no rank read, unless its family lists it in models/unused.py:
  `check_all_read`, over every rank loading the checkpoint.
"""

from __future__ import annotations

import torch

from atoll.errors import CheckpointError
from atoll.models import fp8
from atoll.models.unused import known_unused

LOADABLE = ("F32", "F16", "BF16", "F64")  # safetensors' names, cast to the compute dtype as copied


def source(ckpt, name: str, get, scheme, device="cpu"):
    """The lazy source the weight_loaders read `name` through: get(name) for float tensors, an
    fp8 source (weight and scales, dequantized on `device`) for an fp8 weight of a checkpoint
    with an fp8 `scheme` (models.fp8_scheme.Scheme)."""
    dtype = ckpt.dtype(name)
    if dtype in LOADABLE:
        return get(name)
    if dtype not in fp8.FP8_DTYPES:
        raise CheckpointError(f"tensor {name} is stored as {dtype}, which atoll cannot load (it reads "
                              f"{', '.join(LOADABLE)}, and fp8 weights of fp8-quantized checkpoints)")
    if scheme is None:
        raise CheckpointError(f"tensor {name} is stored as {dtype} but config.json has no fp8 "
                              "quantization_config")
    scale = scheme.scale_of(name)
    if scale not in ckpt.weight_map:
        kind = "block scales" if scheme.block else "scales"
        raise CheckpointError(f"tensor {name} is stored as {dtype} without its {kind} {scale}")
    if ckpt.dtype(scale) not in LOADABLE:
        raise CheckpointError(f"tensor {scale} is stored as {ckpt.dtype(scale)}; fp8 scales must be float")
    if scheme.block:
        return fp8.Fp8Source(name, get(name), get(scale), scheme.block, device)
    inp = scheme.input_of(name)
    has_input = inp is not None and inp in ckpt.weight_map
    if scheme.static_inputs and not has_input:
        raise CheckpointError(f"tensor {name} has no static input scale {inp} (config.json says the "
                              "activations are static)")
    if has_input and ckpt.dtype(inp) not in LOADABLE:
        raise CheckpointError(f"tensor {inp} is stored as {ckpt.dtype(inp)}; fp8 scales must be float")
    return fp8.ChannelFp8Source(name, get(name), get(scale), get(inp) if has_input else None, device,
                                scale_name=scale, input_name=inp)


def is_fp8_scale(ckpt, name: str, scheme) -> bool:
    """Whether `name` is the scales (or the static input scale) of an fp8 weight, read with
    the weight."""
    weight = scheme.weight_of(name) if scheme is not None else None
    return weight is not None and weight in ckpt.weight_map and ckpt.dtype(weight) in fp8.FP8_DTYPES


def shard_ids(model, param: str) -> tuple:
    """The shard ids parameter `param` (a name in model.named_parameters()) is filled from: its
    layer's shard_ids entry (a merged layer's, layers/linear.py, or the experts'), else (None,),
    one checkpoint tensor."""
    owner, _, name = param.rpartition(".")
    return getattr(model.get_submodule(owner), "shard_ids", {}).get(name, (None,))


def check_filled(model, ckpt, loaded: set) -> None:
    """Every (parameter, shard) this rank holds was filled; else name the first tensor lacking."""
    needed = {(p, s) for p, _ in model.named_parameters() for s in shard_ids(model, p)}
    missing = sorted(needed - loaded, key=str)
    if not missing:
        return
    name_of = getattr(model, "checkpoint_name", lambda p, s: p if s is None else f"{p} ({s})")
    names = sorted({name_of(p, s) for p, s in missing})
    raise CheckpointError(f"checkpoint {ckpt.dir} lacks tensor {names[0]}"
                          + (f" and {len(names) - 1} more" if len(names) > 1 else ""))


def check_all_read(ckpt, read: set, config, world=None) -> None:
    """Every checkpoint tensor was read by some rank of `world` (a Group; None: this process
    alone), or is known unused for config's family; else name the first one nobody read.
    Every rank of world must call it: the ranks agree through one all_reduce."""
    names = ckpt.names()
    flags = [int(n in read) for n in names]
    if world is not None and world.size > 1:
        mask = torch.tensor(flags, dtype=torch.int32, device=world.device)
        flags = world.all_reduce(mask, op="max").tolist()  # once, at load time
    unread = [n for n, f in zip(names, flags) if not f and not (config is not None and known_unused(n, config))]
    if unread:
        family = f"the {config.model_type} model" if config is not None else "the model"
        raise CheckpointError(f"checkpoint tensor {unread[0]} is read by no parameter of {family}"
                              + (f" (and {len(unread) - 1} more)" if len(unread) > 1 else ""))
