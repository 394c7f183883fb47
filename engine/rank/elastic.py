"""Elastic EP on one surviving rank: its MoE layers switched to the placement their ep group
keeps after losing ranks (comm.elastic.survive), the experts that had no copy left read again
from the checkpoint into the slots this rank gives them.

    keep = survive_layers(placements, lost, checkpoint_has(model, ckpt))   # every survivor alike
    refill(model, ckpt, keep, me)                                          # me: the new ep rank
    carry(old, new, keep, old_rank, me, ckpt)   # a rebuilt stage: the kept weights, then refill

`refill` writes in place, with the experts' own weight_loaders (the same slices, and fp8
scales, a start reads), so a captured CUDA graph or a compiled step keeps reading the same
storage. A survivor whose slots grow (an orphan given a new slot, when no spare copy was left)
needs a stage rebuilt with that many slots: `carry` fills one from the stage before the loss.
"""

from __future__ import annotations

import torch

from atoll.comm.elastic import Survival
from atoll.errors import ConfigError
from atoll.models.strict import source
from atoll.models.fp8_scheme import scheme as fp8_scheme

PARTS = (("w13", 0), ("w13", 1), ("w2", "down"))  # the checkpoint tensors of one expert


def expert_params(model) -> dict[int, str]:
    """Each MoE layer id -> the name of its Experts module (its parameters' prefix)."""
    names = {id(m): n for n, m in model.named_modules()}
    return {layer: names[id(moe.experts)] for layer, moe in zip(model.moe_layer_ids, model.moe_layers)}


def checkpoint_has(model, ckpt):
    """loadable(layer, expert): whether the checkpoint holds every tensor of that expert, in a
    file this rank can still reach."""
    prefixes, held = expert_params(model), set(ckpt.names())

    def loadable(layer: int, expert: int) -> bool:
        names = [model.checkpoint_name(f"{prefixes[layer]}.{p}", (expert, part)) for p, part in PARTS]
        return all(n in held and ckpt.path_of(n).exists() for n in names)

    return loadable


@torch.no_grad()
def refill(model, ckpt, survivals: dict[int, Survival], me: int) -> int:
    """Switch every MoE layer of this rank (new ep rank `me`) to its survival's placement and
    read the experts it must load from the checkpoint; returns the bytes written."""
    prefixes = expert_params(model)
    scheme = fp8_scheme(getattr(model.config, "raw", None) or {})
    written = 0
    for layer, moe in zip(model.moe_layer_ids, model.moe_layers):
        s = survivals[layer]
        experts, local = moe.experts, s.placement.local(me)
        if len(local) != len(experts.logical):
            raise ConfigError(f"MoE layer {layer}: ep rank {me} would hold {len(local)} expert slots, "
                              f"its weights have {len(experts.logical)}: growing a rank's slots is not supported")
        mine = [x for x in s.loads if x.rank == me]
        experts.logical = list(local)  # the loaders fill every slot holding the expert they read
        for x in mine:
            for p, part in PARTS:
                param = getattr(experts, p)
                name = model.checkpoint_name(f"{prefixes[layer]}.{p}", (x.expert, part))
                src = source(ckpt, name, ckpt.get, scheme, param.device)
                if param.dtype == torch.float8_e4m3fn and hasattr(src, "raw"):
                    src = src.raw()  # a weight kept in fp8 takes the stored values, as a start does
                param.weight_loader(param, src, (x.expert, part))
            written += sum(t[x.slot].numel() * t.element_size() for t in experts.slot_tensors())
        moe.placement = s.placement
        if moe.expert_map is not None:
            moe.expert_map.set(s.placement)
    return written


@torch.no_grad()
def carry(old, new, survivals: dict[int, Survival], old_rank: int, me: int, ckpt) -> int:
    """Fill `new` (this rank's stage rebuilt for the shrunk layout, the same shapes but its MoE
    slots) from `old` (its stage before the loss, as ep rank old_rank): every other weight copied,
    each expert slot the survivor kept copied from its old slot, then the MoE layers switched to
    the kept placement and the experts without a copy read from the checkpoint (`refill`).
    Returns the bytes read from the checkpoint."""
    prefixes = expert_params(new)
    slot_names = {f"{prefix}.{p}" for prefix in prefixes.values() for p in ("w13", "w2")}
    before = old.state_dict()
    for name, t in new.state_dict().items():
        if name in slot_names:
            continue
        if name not in before or before[name].shape != t.shape:
            raise ValueError(f"{name}: {tuple(t.shape)} in the rebuilt stage, "
                             f"{tuple(before[name].shape) if name in before else 'nothing'} before the loss")
        t.copy_(before[name])
    for layer, was, now in zip(new.moe_layer_ids, old.moe_layers, new.moe_layers):
        held, kept = was.placement.local(old_rank), survivals[layer].placement.local(me)
        for src, dst in zip((was.experts.w13, was.experts.w2), (now.experts.w13, now.experts.w2)):
            for j, e in enumerate(kept):
                if j < len(held) and held[j] == e:
                    dst[j].copy_(src[j])
    return refill(new, ckpt, survivals, me)
