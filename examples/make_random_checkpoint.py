"""A Llama-3-8B-shaped checkpoint with random weights, for benchmarks that need the real shape
but not the real weights (examples/gpu_check.sh runs `atoll bench` on it).

    python examples/make_random_checkpoint.py /tmp/llama3-8b-random            # on a GPU, ~16 GB
    python examples/make_random_checkpoint.py /tmp/tiny --shape tiny --device cpu

The model is built on the meta device (no memory, and transformers' per-module weight init
runs on nothing), moved with `to_empty` to --device, and filled in place there: N(0, 0.02)
for every matrix and 1 for every norm, drawn by torch on the device. On a GPU that takes well
under a second for 8B parameters; transformers' own init on the CPU would take minutes. The
non-persistent rotary buffers stay uninitialised, which is harmless: save_pretrained skips
them and the loaders recompute them. Writing the safetensors (through the host) is the slow
part: about 16 GB.
"""

from __future__ import annotations

import argparse
import time

SHAPES = {
    # meta-llama/Meta-Llama-3-8B's config.json, less the tokenizer ids
    "llama3-8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192,
                      rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # SmolLM2-135M's shape with 8 query and 4 key/value heads (its own 9 and 3 split over no
    # even TP size): the CPU benches of TP2 run on it
    "smollm2-tp2": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=8,
                        num_key_value_heads=4, vocab_size=49152, max_position_embeddings=2048,
                        rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
    # the same proportions, small enough to check this script on a CPU
    "tiny": dict(hidden_size=64, intermediate_size=224, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, max_position_embeddings=512,
                 rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
    # twice as wide, with an 8k context: 4k-token prompts on CPU ranks (examples/shifting_load.py)
    "tiny-8k": dict(hidden_size=128, intermediate_size=448, num_hidden_layers=2, num_attention_heads=4,
                    num_key_value_heads=2, vocab_size=512, max_position_embeddings=8192,
                    rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False),
}


def make(out_dir: str, *, shape: str = "llama3-8b", device: str = "cuda", dtype: str = "bfloat16",
         seed: int = 0) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch_dtype = getattr(torch, dtype)
    config = LlamaConfig(**SHAPES[shape], bos_token_id=1, eos_token_id=2)
    config.dtype = torch_dtype  # written to config.json: the runtime's default dtype on CUDA
    t0 = time.perf_counter()
    with torch.device("meta"):
        model = LlamaForCausalLM(config).to(torch_dtype)
    model = model.to_empty(device=device).eval()
    gen = torch.Generator(device=device).manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 1:  # the RMSNorm weights
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=gen)
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)
    t1 = time.perf_counter()
    params = sum(p.numel() for p in model.parameters())
    print(f"built {params / 1e9:.2f} B parameters ({params * model.dtype.itemsize / 1e9:.1f} GB {dtype}) "
          f"on {device} in {t1 - t0:.1f} s", flush=True)
    model.save_pretrained(out_dir, safe_serialization=True, max_shard_size="5GB")  # as the real one: 4 files
    print(f"saved {out_dir} in {time.perf_counter() - t1:.1f} s", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out_dir")
    p.add_argument("--shape", choices=SHAPES, default="llama3-8b")
    p.add_argument("--device", default="cuda", help="where the weights are drawn (default cuda)")
    p.add_argument("--dtype", choices=("bfloat16", "float16", "float32"), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    make(args.out_dir, shape=args.shape, device=args.device, dtype=args.dtype, seed=args.seed)


if __name__ == "__main__":
    main()
