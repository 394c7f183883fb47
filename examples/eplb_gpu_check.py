"""Expert load counting and EPLB under CUDA graphs, on one GPU: what the CPU suite runs only
through the graph buffers without capture (tests/engine/moe/test_eplb_engine.py).

    python examples/eplb_gpu_check.py            # on a GPU (float32; about a minute)
    python examples/eplb_gpu_check.py --device cpu

A tiny Qwen3-MoE of seeded random weights (8 experts, top 2, 3 layers), at TP1 on --device
with its default decode step (CUDA graphs on a GPU), 3 prompts at max_num_seqs 4: every decode
step runs the bucket of 4 rows, one of them padding.
1. counting: without EPLB, each layer counted every (token, expert) pair once (the captured
   graph's counters leave the padding row out: static_exchange's real rows), and the tokens
   are transformers';
2. rebalancing: --enable-eplb with 2 redundant slots and a rebalance every 4 steps: each
   layer's weights and routing tables are rewritten in place between two replays of the
   captured graphs, and the tokens are still transformers'.
Prints PASS or FAIL per check; exit status 1 on any failure.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8]]
NEW = 16


def tiny_moe(out: Path) -> Path:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model("qwen3_moe", vocab_size=301, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                  max_position_embeddings=256, tie_word_embeddings=False, initializer_range=0.1,
                                  num_experts=8, num_experts_per_tok=2, moe_intermediate_size=32,
                                  decoder_sparse_step=1, norm_topk_prob=True, use_sliding_window=False)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.float32).save_pretrained(out, safe_serialization=True)
    return out


def reference(model_dir, device: str) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(device)
    out = []
    with torch.inference_mode():
        for ids in PROMPTS:
            res = model(torch.tensor([ids], device=device), use_cache=True)
            tokens = [int(res.logits[0, -1].argmax())]
            while len(tokens) < NEW:
                key = "cache" if "cache" in res else "past_key_values"
                res = model(torch.tensor([[tokens[-1]]], device=device), **{key: res[key]}, use_cache=True)
                tokens.append(int(res.logits[0, -1].argmax()))
            out.append(tokens)
    return out


def run(model_dir, device: str, **options):
    from atoll import LLM, SamplingParams

    llm = LLM(str(model_dir), layout="TP1", device=device, max_num_seqs=4, block_size=4, **options)
    requests = llm.prepare(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    try:
        outs = llm.generate_requests(requests, link_stats=True)
    finally:
        llm.close()
    return [o["token_ids"] for o in outs], llm.links["expert_load"]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda")
    args = p.parse_args()
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = tiny_moe(Path(tmp) / "qwen3-moe")
        expected = reference(model_dir, args.device)
        pairs = (sum(map(len, PROMPTS)) + len(PROMPTS) * (NEW - 1)) * 2
        tokens, report = run(model_dir, args.device)
        counted = {k: sum(v["tokens"]) for k, v in report["layers"].items()}
        ok = tokens == expected and counted == {0: pairs, 1: pairs, 2: pairs}
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} counting: {counted} pairs per layer, {pairs} routed; "
              f"tokens {'as transformers' if tokens == expected else f'{tokens} != {expected}'}", flush=True)
        tokens, report = run(model_dir, args.device, enable_eplb=True, num_redundant_experts=2,
                             eplb_step_interval=4, eplb_window_size=4)
        ok = tokens == expected and report["layers_moved"] > 0
        failed += not ok
        print(f"{'PASS' if ok else 'FAIL'} rebalancing: {report['rebalances']} rebalances, {report['layers_moved']} "
              f"layers switched between graph replays; tokens "
              f"{'as transformers' if tokens == expected else f'{tokens} != {expected}'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
