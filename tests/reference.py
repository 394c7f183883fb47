"""The transformers reference that parity tests compare against."""

import torch


def reference_tokens(model_dir, prompts, new_tokens):
    """transformers' greedy continuation of each prompt alone, without EOS stopping: a plain
    loop over the model's forward with its own KV cache (generate's min_new_tokens would
    mask EOS and so change the argmax)."""
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in prompts:
            res = ref(torch.tensor([p]), use_cache=True)
            tokens = [int(res.logits[0, -1].argmax())]
            while len(tokens) < new_tokens:
                # transformers 5 names the cache `cache`; older releases `past_key_values`
                key = "cache" if "cache" in res else "past_key_values"
                res = ref(torch.tensor([[tokens[-1]]]), **{key: res[key]}, use_cache=True)
                tokens.append(int(res.logits[0, -1].argmax()))
            out.append(tokens)
    return out


def reference_cache(tiny_model, families: dict, prompts, new_tokens):
    """name -> (model dir, reference tokens), each built once: families maps a name to
    (tiny model kind, config overrides)."""
    cache = {}

    def get(name):
        if name not in cache:
            kind, overrides = families[name]
            d = tiny_model(kind, **overrides)
            cache[name] = (d, reference_tokens(d, prompts, new_tokens))
        return cache[name]

    return get
