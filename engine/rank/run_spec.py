"""RunSpec: what every rank of an engine needs to build its part of the model, and the dtype it
computes in."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass

import torch

from atoll import config
from atoll.config import EngineConfig
from atoll.models import ModelConfig

DTYPES = {name: getattr(torch, name) for name in config.DTYPES}


@dataclass(frozen=True)
class RunSpec:
    """What every rank needs to build its part of the model; picklable. The engine options
    are the run's EngineConfig (config/engine.py holds every default); the rest is what the
    driver resolved for this run."""

    model_dir: str
    layout: str
    engine: EngineConfig
    max_model_len: int  # this run's context: the config's or the model's, bounded by the requests
    max_num_batched_tokens: int  # the config's, else its default for the device (config.default_batched_tokens)
    cache_seqs: int | None = None  # sequences per lane the default CPU cache holds (None: max_num_seqs)
    decode_steps: int | None = None  # decode steps a rank expects to run (engine.step.policy; None: unknown)

    def with_engine(self, **changes) -> "RunSpec":
        """This spec with some engine options changed."""
        return dataclasses.replace(self, engine=dataclasses.replace(self.engine, **changes))

    def for_engine(self, name: str) -> "RunSpec":
        """The spec of one of several engines started together (replicas, or a disaggregated
        job's engines): its --kv-disk-dir is a subdirectory `name` of the one given, since a
        disk tier's directory is one engine's alone (engine/kv/tiers/disk.py). A replica
        ("replica{k}") meets only the faults that name it or no replica (config.faults)."""
        spec, faults = self, self.engine.fault_injection
        if faults is not None and name.startswith("replica") and name[len("replica"):].isdigit():
            spec = spec.with_engine(fault_injection=faults.for_replica(int(name[len("replica"):])))
        if not self.engine.kv_disk_dir:
            return spec
        return spec.with_engine(kv_disk_dir=os.path.join(self.engine.kv_disk_dir, name))

    @classmethod
    def of(cls, model_dir, layout, *, max_model_len: int, cache_seqs: int | None = None, **options) -> "RunSpec":
        """A spec from engine options given as keywords (tests, calibration)."""
        engine = EngineConfig(**options)
        return cls(str(model_dir), str(layout), engine, max_model_len, engine.batched_tokens(),
                   cache_seqs)


def resolve_dtype(requested: str | None, config: ModelConfig, device: torch.device) -> torch.dtype:
    """--dtype if given; else the checkpoint's dtype on CUDA (bf16 for most), float32 on CPU."""
    if requested is not None:
        return DTYPES[requested]
    if device.type != "cuda":
        return torch.float32
    raw = config.raw.get("torch_dtype") or config.raw.get("dtype") or "float32"
    return DTYPES.get(str(raw).removeprefix("torch."), torch.float32)
