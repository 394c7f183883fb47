"""Read a Hugging Face safetensors checkpoint one slice at a time.

`Checkpoint(dir).get(name)` returns a lazy source: indexing it (`src[a:b]`, `src[:, a:b]`)
reads only that slice from the file. Every byte handed out is counted, so a test can show
that a rank read about 1/tp of its stage's weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from atoll.errors import CheckpointError
from atoll.models import fp8
from atoll.models.fp8_scheme import scheme as fp8_scheme
from atoll.models.header_source import HeaderSource
from atoll.models.safetensors_header import INDEX, read_header, slice_stops
from atoll.models.strict import check_all_read, check_filled, is_fp8_scale, source
from atoll.models.unused import known_unused



class Source:
    """One checkpoint tensor, read lazily; indexing returns a torch tensor."""

    def __init__(self, name: str, slice_, checkpoint: "Checkpoint"):
        self.name = name
        self._slice = slice_
        self._ckpt = checkpoint
        self._shape = tuple(slice_.get_shape())

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    def __getitem__(self, index):
        past = [(d, s) for d, s in enumerate(slice_stops(index, len(self._shape))) if s and s > self._shape[d]]
        if past:  # safetensors would hand back a shorter slice; the header check names it before this
            d, stop = past[0]
            raise CheckpointError(f"tensor {self.name} does not fit the model config: "
                                  f"{self._ckpt.path_of(self.name)} stores it as {self._shape}, the model "
                                  f"reads dim {d} to {stop}")
        with torch.device("cpu"):  # a host view of the file; the weight_loader copies it to the device
            t = self._slice[index]
        self._ckpt.bytes_read += t.numel() * t.element_size()
        self._ckpt.tensors_read[self.name] = self._ckpt.tensors_read.get(self.name, 0) + t.numel()
        return t


class Checkpoint:
    def __init__(self, directory: str | Path):
        self.dir = Path(directory)
        if not self.dir.is_dir():
            raise CheckpointError(f"checkpoint directory {self.dir} does not exist")
        self._files: dict[str, object] = {}
        self._keys: dict[str, set] = {}  # file -> the tensors its header lists
        self.weight_map = self._weight_map()
        self.bytes_read = 0
        self.tensors_read: dict[str, int] = {}

    def _weight_map(self) -> dict[str, str]:
        index = self.dir / INDEX
        if index.exists():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as e:
                raise CheckpointError(f"{index} is not a valid safetensors index: {e}") from None
            except OSError as e:
                raise CheckpointError(f"cannot read {index}: {e.strerror}") from None
            if not isinstance(weight_map, dict) or not weight_map:
                raise CheckpointError(f"{index}: weight_map must be a non-empty JSON object "
                                      '{"tensor name": "shard file"}, not '
                                      f"{type(weight_map).__name__} {str(weight_map)[:40]}")
            bad = next((v for v in weight_map.values() if not isinstance(v, str) or not v), None)
            if bad is not None:
                raise CheckpointError(f"{index}: weight_map value {bad!r} is not a shard file name "
                                      "in the checkpoint directory")
            for f in sorted(set(weight_map.values())):
                if not (self.dir / f).is_file():
                    names = sorted(k for k, v in weight_map.items() if v == f)
                    more = f" and {len(names) - 1} more" if len(names) > 1 else ""
                    raise CheckpointError(f"shard {f} listed in {INDEX} for tensor {names[0]}{more} is missing "
                                          f"from {self.dir}")
            return weight_map
        files = sorted(self.dir.glob("*.safetensors"))
        if not files:
            raise CheckpointError(f"no *.safetensors files in {self.dir}")
        return {name: f.name for f in files for name in self._open(f.name).keys()}

    def _open(self, filename: str):
        handle = self._files.get(filename)
        if handle is None:
            path = self.dir / filename
            keys = set(read_header(path))  # a truncated file: named with the tensor it cuts
            try:
                handle = safe_open(str(path), framework="pt")
            except Exception as e:  # safetensors raises its own error type for bad headers
                raise CheckpointError(f"cannot read {path}: corrupt safetensors header ({e})") from None
            self._files[filename], self._keys[filename] = handle, keys
        return handle

    def _slice(self, name: str):
        """The safetensors slice of `name`, from the file the weight map names; a file that
        does not hold it (an index pointing at the wrong shard) is named with the index."""
        f = self.weight_map[name]
        if name not in self._held(f):
            where = [g for g in sorted(set(self.weight_map.values()) - {f}) if name in self._held(g)]
            raise CheckpointError(f"{self.dir / INDEX} maps tensor {name} to {f}, which does not hold it"
                                  + (f" (it is in {where[0]})" if where else ""))
        return self._open(f).get_slice(name)

    def _held(self, filename: str) -> set:
        """The tensor names file `filename`'s header lists."""
        self._open(filename)
        return self._keys[filename]

    def check(self) -> None:
        """Every shard's header read once and every tensor found where the index says, so a
        truncated, corrupt or misplaced file fails before any rank starts."""
        for f in sorted(set(self.weight_map.values())):
            self._open(f)
        for name in self.weight_map:
            self._slice(name)

    def path_of(self, name: str) -> Path:
        """The file holding tensor `name`."""
        return self.dir / self.weight_map[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def header(self, name: str):
        return HeaderSource(name, self.shape(name))

    def dtype(self, name: str) -> str:
        """The tensor's dtype as safetensors names it ("BF16", "F8_E4M3"), from its header."""
        return self._slice(name).get_dtype()

    def names(self) -> list[str]:
        return list(self.weight_map)

    def get(self, name: str) -> Source:
        if name not in self.weight_map:
            raise CheckpointError(f"checkpoint {self.dir} has no tensor {name}")
        return Source(name, self._slice(name), self)

    def total_bytes(self) -> int:
        total = 0
        for name in self.weight_map:
            s = self._slice(name)
            n = 1
            for d in s.get_shape():
                n *= d
            total += n * _DTYPE_BYTES.get(s.get_dtype(), 4)
        return total


_DTYPE_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                "F8_E4M3": 1, "F8_E5M2": 1, "BOOL": 1}


@dataclass
class Loaded:
    """What load_weights did with the checkpoint's tensors on this rank: `read`, the names a
    weight_loader took; `offered`, the names handed to a parameter this rank holds (a superset:
    another ep rank's expert is offered here and not read)."""

    read: set = field(default_factory=set)
    offered: set = field(default_factory=set)


def load_weights(model, ckpt: Checkpoint, *, get=None, world=None) -> Loaded:
    """Hand each checkpoint tensor that this rank holds to its parameter's weight_loader.

    `model.checkpoint_targets(name)` maps a checkpoint name to (parameter name, shard id)
    pairs; tensors of other stages map to parameters this rank lacks and are never read. A
    weight_loader returns False for a shard it does not hold (another rank's expert), and the
    layer holding a parameter lists the shard ids it must receive in its `shard_ids` (default:
    one, None; models/strict.shard_ids).
    An fp8 weight is read with its scales through an fp8.Fp8Source (block scales) or an
    fp8.ChannelFp8Source (per tensor or per channel, and a static input scale).

    Strict (models/strict.py): a dtype atoll cannot read or a parameter left unfilled raises a
    CheckpointError naming the tensor; given `world`, the Group of every rank loading the
    checkpoint, so does a tensor that no rank read and models/unused.py does not list for the
    family (every rank of world must call this: they agree through one all_reduce).
    """
    get = get or ckpt.get  # ckpt.header: shapes only (check_layout_fits)
    config = getattr(model, "config", None)  # None: a bare module (a test's block) skips nothing
    scheme = fp8_scheme(getattr(config, "raw", None) or {})
    params = dict(model.named_parameters())
    loaded, done = set(), Loaded()
    for name in ckpt.names():
        if is_fp8_scale(ckpt, name, scheme) or (config is not None and known_unused(name, config)):
            continue  # scales are read with their weight
        for target, shard in model.checkpoint_targets(name):
            param = params.get(target)
            if param is None:
                continue
            src = source(ckpt, name, get, scheme, param.device)
            if isinstance(src, fp8.Fp8Source) and param.dtype == torch.float8_e4m3fn:
                src = src.raw()  # a weight kept in fp8 (--quantization fp8) takes the stored values
            try:
                took = param.weight_loader(param, src, shard)
            except ValueError as e:
                raise CheckpointError(f"tensor {name} does not fit the model config: {e}; "
                                      f"{ckpt.path_of(name)} stores it as {tuple(src.shape)}") from None
            parts = src.parts if isinstance(src, fp8.Fp8Source) else {name}
            done.offered |= parts
            if took is not False:
                loaded.add((target, shard))
                done.read |= parts
    if world is not None:
        check_all_read(ckpt, done.read, config, world)
    check_filled(model, ckpt, loaded)
    return done
