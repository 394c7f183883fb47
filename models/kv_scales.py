"""fp8 KV cache scales (--kv-cache-dtype fp8): where a run's come from, and the file `atoll
calibrate-kv` writes.

A model's scales are, per layer, one float32 per kv head for keys and one for values, and a
sink per kv head and channel for each (the first position's key and value: layers/kv_quant.py
says why); MLA's latent cache is one "head" with a key scale and no v or sink. Sources, the
first that holds (the ranks decide, engine/rank/kv_cache.scales_for):

1. --kv-scales FILE: a file of calibrate-kv's, given;
2. --calculate-kv-scales: each layer fits its own on the first prefill (vLLM's flag, which
   computes them whatever the checkpoint holds);
3. the checkpoint's tensors, named as vLLM and ModelOpt write them: model.layers.N.self_attn.
   k_scale / v_scale (llm-compressor, compressed-tensors), ...self_attn.k_proj.k_scale /
   v_proj.v_scale (ModelOpt), ...self_attn.attn.k_scale / v_scale (vLLM's own), or the
   deprecated ...kv_scale for both (read as vLLM reads it); one per tensor ([] or [1]) or one
   per kv head ([kv_heads]); no sink;
4. FILE_NAME beside the checkpoint (calibrate-kv's default output);
5. none: scale 1 and sink 0, vLLM's default.

The file is JSON: {"format": FORMAT, "version": 1, "model_type", "num_hidden_layers",
"num_key_value_heads" (1 for MLA), "head_dim" (MLA: the latent's width), "how": {...},
"layers": [{"k_scale": [per kv head], "v_scale": [...] or null, "k_sink": [[per channel] per kv
head] or null, "v_sink": the same or null}, ...]}. calibrate-kv never replaces a file it did not write without being
told (--force), nor writes over another tool's: see cli/calibrate_kv.py.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from atoll.errors import CheckpointError, InputError

FILE_NAME = "atoll-kv-scales.json"
FORMAT = "atoll-kv-scales"
# a checkpoint's KV scale tensor: (layer, where, which); read by the KV cache, no parameter's
CHECKPOINT_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.(?:(k_proj|v_proj|attn)\.)?(k|v|kv)_scale")


@dataclass(frozen=True)
class ModelScales:
    """The whole model's fp8 KV scales: per layer, per kv head."""

    source: str  # says where they came from, in the run's line
    k: list[list[float]]  # [layers][kv_heads]
    v: list[list[float]] | None  # [layers][kv_heads]; None for MLA
    k_sink: list[list[list[float]]] | None = None  # [layers][kv_heads][head_dim]; None: 0
    v_sink: list[list[list[float]]] | None = None

    def for_rank(self, layers: range, heads: list[int]) -> list[tuple]:
        """(k scales, v scales or None, k sinks or None, v sinks or None) of each of `layers` for
        the kv heads `heads` a rank holds: what layers.attention.KVCache takes."""
        def pick(x, i):
            return None if x is None else [x[i][h] for h in heads]

        return [(pick(self.k, i), pick(self.v, i), pick(self.k_sink, i), pick(self.v_sink, i)) for i in layers]


def cache_shape(config) -> tuple[int, int, bool]:
    """(kv heads, values per head, whether v is separate) of one layer's cache, all ranks together."""
    if config.is_mla:
        return 1, config.kv_lora_rank + config.qk_rope_head_dim, False
    return config.num_key_value_heads, config.head_dim, True


def rank_heads(config, tp: int, rank: int) -> list[int]:
    """The kv heads TP rank `rank` holds (layers.linear.QKVParallelLinear's split; MLA's one)."""
    heads = cache_shape(config)[0]
    if config.is_mla:
        return [0]
    if heads >= tp:
        share = heads // tp
        return list(range(rank * share, (rank + 1) * share))
    return [rank // (tp // heads)]


def is_checkpoint_scale(name: str) -> bool:
    """Whether checkpoint tensor `name` is a KV cache scale (read here, by no parameter)."""
    return CHECKPOINT_NAME.fullmatch(name) is not None


def from_checkpoint(ckpt, config) -> ModelScales | None:
    """The checkpoint's k_scale/v_scale tensors (vLLM's and ModelOpt's names), or None if it has none."""
    found: dict[tuple[int, str], list[float]] = {}
    where: dict[tuple[int, str], str] = {}
    heads = cache_shape(config)[0]
    for name in ckpt.names():
        m = CHECKPOINT_NAME.fullmatch(name)
        if m is None:
            continue
        layer, which = int(m.group(1)), m.group(3)
        if layer >= config.num_hidden_layers:
            continue  # an MTP layer's (models/unused.after_last_layer)
        values = ckpt.get(name)[...].float().reshape(-1).tolist()
        if len(values) not in (1, heads):
            raise CheckpointError(f"tensor {name} has {len(values)} values; a KV scale is one per tensor or one "
                                  f"per kv head ({heads})")
        values = values * heads if len(values) == 1 else values
        if any(not v > 0 for v in values):
            raise CheckpointError(f"tensor {name} holds a scale that is not positive: {values}")
        for w in (("k", "v") if which == "kv" else (which,)):
            if (layer, w) not in found or which != "kv":  # k_scale/v_scale win over the deprecated kv_scale
                found[(layer, w)], where[(layer, w)] = values, name
    if not found:
        return None
    layers = config.num_hidden_layers
    kinds = ("k", "v") if cache_shape(config)[2] else ("k",)
    missing = [f"{w}_scale of layer {i}" for i in range(layers) for w in kinds if (i, w) not in found]
    if missing:
        raise CheckpointError(f"checkpoint {ckpt.dir} has KV scales for some layers but no {missing[0]}"
                              + (f" (and {len(missing) - 1} more)" if len(missing) > 1 else ""))
    k = [found[(i, "k")] for i in range(layers)]
    v = [found[(i, "v")] for i in range(layers)] if "v" in kinds else None
    return ModelScales(f"the checkpoint's k_scale/v_scale ({where[(0, 'k')]}, ...)", k, v)


def read_file(path, config) -> ModelScales:
    """A calibrate-kv file, checked against the model's config; one-line errors."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except FileNotFoundError:
        raise InputError(f"--kv-scales {path}: no such file") from None
    except (OSError, ValueError) as e:
        raise InputError(f"{path} is not a KV scales file: {e}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise InputError(f"{path} is not a KV scales file of atoll calibrate-kv (no \"format\": \"{FORMAT}\")")
    heads, dim, values = cache_shape(config)
    want = {"num_hidden_layers": config.num_hidden_layers, "num_key_value_heads": heads, "head_dim": dim}
    for key, n in want.items():
        if raw.get(key) != n:
            raise InputError(f"{path} was calibrated for {key}={raw.get(key)}, the model has {n}")
    layers = raw.get("layers")
    if not isinstance(layers, list) or len(layers) != config.num_hidden_layers:
        raise InputError(f"{path} holds {len(layers) if isinstance(layers, list) else 'no'} layers, "
                         f"the model has {config.num_hidden_layers}")
    try:
        k = [_floats(layer["k_scale"], heads) for layer in layers]
        v = [_floats(layer["v_scale"], heads) for layer in layers] if values else None
        sinks = [_sinks(layers, name, heads, dim) for name in ("k_sink", "v_sink")]
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"{path}: a layer's scales are malformed ({e})") from None
    if any(not s > 0 for row in k + (v or []) for s in row):
        raise InputError(f"{path} holds a scale that is not positive")
    return ModelScales(f"{path}", k, v, *sinks)


def write_file(path, config, scales: ModelScales, how: dict) -> None:
    """Write `scales` as a calibrate-kv file (the caller checked the path is free to write)."""
    heads, dim, _ = cache_shape(config)
    layers = []
    for i in range(config.num_hidden_layers):
        layers.append({name: None if x is None else x[i] for name, x in (
            ("k_scale", scales.k), ("v_scale", scales.v), ("k_sink", scales.k_sink), ("v_sink", scales.v_sink))})
    out = {"format": FORMAT, "version": 1, "model_type": config.model_type,
           "num_hidden_layers": config.num_hidden_layers, "num_key_value_heads": heads, "head_dim": dim,
           "how": how}
    head = json.dumps(out, indent=1)[:-2]  # without the closing "\n}": the layers follow, one a line
    rows = ",\n".join("  " + json.dumps(layer) for layer in layers)
    Path(path).write_text(f"{head},\n \"layers\": [\n{rows}\n ]\n}}\n")


def written_by_calibrate(path) -> bool:
    """Whether the file at `path` is one calibrate-kv wrote (its format tag)."""
    try:
        return json.loads(Path(path).read_text()).get("format") == FORMAT
    except (OSError, ValueError, AttributeError):
        return False


def _sinks(layers: list, name: str, heads: int, dim: int) -> list | None:
    """Every layer's `name` ([kv_heads][head_dim]), or None where the file has none."""
    if any(layer.get(name) is None for layer in layers):
        return None
    return [[_floats(c, dim) for c in _list(layer[name], heads)] for layer in layers]


def _list(x, n: int) -> list:
    if not isinstance(x, list) or len(x) != n:
        raise ValueError(f"expected a list of {n}")
    return x


def _floats(x, n: int) -> list[float]:
    return [float(v) for v in _list(x, n)]
