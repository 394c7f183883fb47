"""A tiny DeepSeek-V3 given a multi-token-prediction layer: random MTP tensors for layer N =
num_hidden_layers in the checkpoint's own naming, and num_nextn_predict_layers=1."""

import json
import shutil

import torch


def with_mtp_layer(base, d):
    """A copy of the tiny model dir `base` in `d`, with an MTP layer; returns d."""
    from safetensors.torch import load_file, save_file

    for f in base.iterdir():
        shutil.copy(f, d / f.name)
    layers = json.loads((d / "config.json").read_text())["num_hidden_layers"]
    tensors = load_file(str(d / "model.safetensors")) | _mtp_tensors(d, layers)
    save_file(tensors, str(d / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(config | {"num_nextn_predict_layers": 1}))
    return d


def _mtp_tensors(model_dir, layers: int, seed: int = 7) -> dict:
    """Random MTP tensors for layer `layers` in the checkpoint's own naming: the decoder block
    from a transformers DeepSeek-V3 of layers + 1 layers (its last layer, saved by
    save_pretrained), then enorm, hnorm, eh_proj, shared_head and the embedding's copy."""
    from safetensors.torch import load_file
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    config.num_hidden_layers = layers + 1
    torch.manual_seed(seed)
    big = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = model_dir.parent / f"{model_dir.name}-block"
    big.save_pretrained(out, safe_serialization=True)
    prefix = f"model.layers.{layers}."
    # the block's outputs scaled down: its residual stream stays near the hidden half of
    # eh_proj below, so the random MTP proposes tokens the target often takes (a repeat of
    # the pending token), and a test run sees acceptances as well as rejections
    tensors = {n: t * (0.1 if "o_proj" in n or "down_proj" in n else 1.0)
               for n, t in load_file(str(out / "model.safetensors")).items() if n.startswith(prefix)}
    shutil.rmtree(out)
    base = load_file(str(model_dir / "model.safetensors"))
    g = torch.Generator().manual_seed(seed)
    hidden, vocab = config.hidden_size, config.vocab_size

    def near_one(n):
        return 1.0 + 0.1 * torch.randn(n, generator=g)

    tensors[prefix + "enorm.weight"] = near_one(hidden)
    tensors[prefix + "hnorm.weight"] = near_one(hidden)
    # random, leaning on the hidden half (an MTP trained to continue the target's own state)
    eh = 0.01 * torch.randn(hidden, 2 * hidden, generator=g)
    eh[:, hidden:] += torch.eye(hidden)
    tensors[prefix + "eh_proj.weight"] = eh
    tensors[prefix + "shared_head.norm.weight"] = near_one(hidden)
    tensors[prefix + "shared_head.head.weight"] = base["lm_head.weight"] + 0.01 * torch.randn(vocab, hidden, generator=g)
    tensors[prefix + "embed_tokens.weight"] = base["model.embed_tokens.weight"].clone()  # as the official checkpoint
    return tensors
