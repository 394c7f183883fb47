"""How an fp8 checkpoint stores its scales, from config.json's quantization_config:

- block (DeepSeek-V3): quant_method "fp8" with weight_block_size [128, 128]; each fp8 weight
  `<w>` beside `<w>_scale_inv`, one float32 scale per block (models.fp8.Fp8Source);
- per tensor or per output channel (vLLM's fp8 checkpoints): quant_method "fp8" without
  weight_block_size, activation_scheme "dynamic" or "static"; each fp8 weight `<m>.weight`
  beside `<m>.weight_scale` (float32: a scalar, shape [] or [1], or one per output row, [out]
  or [out, 1]) and, with static activations, `<m>.input_scale` (a float32 scalar)
  (models.fp8.ChannelFp8Source);
- the same tensors under quant_method "compressed-tensors" (format float-quantized or
  naive-quantized): 8-bit float weights with strategy "tensor" or "channel", input
  activations absent, dynamic, or static per tensor.

Anything else is refused in one line.
"""

from __future__ import annotations

from dataclasses import dataclass

from atoll.errors import CheckpointError

INPUT_SCALE = "input_scale"
CT_FORMATS = ("float-quantized", "naive-quantized")


@dataclass(frozen=True)
class Scheme:
    block: tuple[int, int] | None = None  # None: a scale per tensor or per output channel
    static_inputs: bool = False  # an input_scale beside each weight (activation_scheme static)

    @property
    def suffix(self) -> str:
        return "_scale_inv" if self.block else "_scale"

    def scale_of(self, name: str) -> str:
        return name + self.suffix

    def input_of(self, name: str) -> str | None:
        """`<m>.input_scale` of weight `<m>.weight` (per tensor/channel checkpoints only)."""
        if self.block or not name.endswith("weight"):
            return None
        return name[: -len("weight")] + INPUT_SCALE

    def weight_of(self, name: str) -> str | None:
        """The weight that scale tensor `name` belongs to, None for any other name."""
        if not self.block and name.endswith(INPUT_SCALE):
            return name[: -len(INPUT_SCALE)] + "weight"
        if name.endswith(self.suffix):
            return name[: -len(self.suffix)]
        return None


def scheme(raw: dict) -> Scheme | None:
    """The checkpoint's fp8 scheme, None when it is not quantized; any other quantization
    is refused."""
    q = raw.get("quantization_config")
    if q is None:
        return None
    if not isinstance(q, dict):
        raise CheckpointError(f"config.json: quantization_config={str(q)[:40]!r} must be a JSON object")
    method = q.get("quant_method")
    if method == "compressed-tensors":
        return _compressed_tensors(q)
    if method != "fp8":
        raise CheckpointError(f"config.json: quantization_config.quant_method={method!r} is not supported; "
                              "atoll reads unquantized checkpoints, fp8 ones and compressed-tensors fp8 ones")
    block = q.get("weight_block_size")
    if block is None:
        act = q.get("activation_scheme", "dynamic")
        if act not in ("dynamic", "static"):
            raise CheckpointError(f"config.json: quantization_config.activation_scheme={act!r} must be "
                                  "dynamic or static")
        return Scheme(static_inputs=act == "static")
    if not (isinstance(block, list) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)):
        raise CheckpointError(f"config.json: quantization_config.weight_block_size={block!r} must be two whole "
                              "numbers such as [128, 128], or absent (a scale per tensor or per channel)")
    return Scheme(block=(block[0], block[1]))


def _compressed_tensors(q: dict) -> Scheme:
    where = "config.json: compressed-tensors quantization_config"
    fmt = q.get("format")
    if fmt not in CT_FORMATS:
        raise CheckpointError(f"{where} format={fmt!r} is not supported; atoll reads "
                              f"{' and '.join(CT_FORMATS)} fp8 weights")
    if q.get("kv_cache_scheme") is not None:
        raise CheckpointError(f"{where} has a kv_cache_scheme, which atoll does not read "
                              "(use --kv-cache-dtype)")
    groups = q.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise CheckpointError(f"{where} needs config_groups")
    static = set()
    for gname, g in groups.items():
        w = (g or {}).get("weights") or {}
        if (w.get("num_bits"), w.get("type"), w.get("strategy")) not in ((8, "float", "tensor"), (8, "float", "channel")):
            raise CheckpointError(f"{where} group {gname}: weights {_brief(w)} are not supported; atoll reads "
                                  "8-bit float weights with strategy tensor or channel")
        a = (g or {}).get("input_activations")
        if a is None or (a.get("num_bits"), a.get("type"), a.get("dynamic")) == (8, "float", True):
            static.add(False)
        elif (a.get("num_bits"), a.get("type"), a.get("strategy")) == (8, "float", "tensor"):
            static.add(True)
        else:
            raise CheckpointError(f"{where} group {gname}: input_activations {_brief(a)} are not supported; "
                                  "atoll reads none, dynamic 8-bit float, or static 8-bit float per tensor")
    if len(static) > 1:
        raise CheckpointError(f"{where} mixes static and dynamic input activations across config_groups")
    return Scheme(static_inputs=static.pop())


def _brief(d: dict) -> str:
    keys = ("num_bits", "type", "strategy", "dynamic")
    return "{" + ", ".join(f"{k}={d.get(k)!r}" for k in keys) + "}"
