"""Save a tiny model as an fp8 block-quantized checkpoint, laid out as the official
DeepSeek-V3 one: each linear weight (a 2-D `*_proj.weight`) in float8_e4m3fn beside its
`weight_scale_inv`, one fp32 scale per 128 x 128 block (the block's amax / 448), every other
tensor as it was, and `quantization_config` in config.json. Beside it the same model with the
dequantized weights in float32: the reference the fp8 checkpoint must load as."""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

BLOCK = 128
E4M3_MAX = 448.0  # the largest float8_e4m3fn


def quantize(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """w [rows, cols] -> (fp8 [rows, cols], scale_inv [ceil(rows/block), ceil(cols/block)])."""
    rows, cols = w.shape
    nr, nc = -(-rows // block), -(-cols // block)
    padded = w.new_zeros(nr * block, nc * block)
    padded[:rows, :cols] = w
    blocks = padded.view(nr, block, nc, block)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / E4M3_MAX  # [nr, nc]
    q = (blocks / scale[:, None, :, None]).view(nr * block, nc * block)[:rows, :cols]
    return q.to(torch.float8_e4m3fn).contiguous(), scale.float()


def dequantize(q: torch.Tensor, scale: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    s = scale.repeat_interleave(block, 0).repeat_interleave(block, 1)[: q.shape[0], : q.shape[1]]
    return q.float() * s


def is_quantized(name: str, t: torch.Tensor) -> bool:
    return t.dim() == 2 and name.endswith("_proj.weight")


def write_fp8_pair(src: Path, fp8_dir: Path, ref_dir: Path) -> tuple[Path, Path]:
    """src (a float32 checkpoint) -> fp8_dir (block-quantized) and ref_dir (dequantized)."""
    src, fp8_dir, ref_dir = Path(src), Path(fp8_dir), Path(ref_dir)
    for d in (fp8_dir, ref_dir):
        d.mkdir(parents=True)
        for f in src.iterdir():
            if f.suffix != ".safetensors" and f.name != "model.safetensors.index.json":
                shutil.copy(f, d / f.name)
    weight_map = {}
    for f in sorted(src.glob("*.safetensors")):
        fp8_t, ref_t = {}, {}
        for name, t in load_file(str(f)).items():
            if is_quantized(name, t):
                q, s = quantize(t)
                fp8_t[name], fp8_t[name + "_scale_inv"] = q, s
                ref_t[name] = dequantize(q, s)
            else:
                fp8_t[name] = ref_t[name] = t.contiguous()
        save_file(fp8_t, str(fp8_dir / f.name), metadata={"format": "pt"})
        save_file(ref_t, str(ref_dir / f.name), metadata={"format": "pt"})
        weight_map.update({name: f.name for name in fp8_t})
    index = src / "model.safetensors.index.json"
    if index.exists():
        shutil.copy(index, ref_dir / index.name)
        (fp8_dir / index.name).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": [BLOCK, BLOCK]}
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))
    return fp8_dir, ref_dir
