"""The transformers reference that parity tests compare against."""

import functools

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


def reference_processed(model_dir, prompts, new_tokens, *, presence=0.0, frequency=0.0, repetition=1.0,
                        bias=None, min_tokens=0, stop_ids=(), bad_words=(), repetition_prompt: bool = True):
    """transformers' greedy continuation of each prompt alone with sampling parameters applied
    to its logits before each argmax, in vLLM's order: bad words (each word's last token
    masked where the generated tokens end with the rest of it; only generated tokens count, as
    in vLLM), min_tokens (transformers' MinNewTokensLengthLogitsProcessor over stop_ids),
    logit_bias (its SequenceBiasLogitsProcessor), repetition (its
    RepetitionPenaltyLogitsProcessor over prompt and output; over the output alone with
    repetition_prompt=False), then OpenAI's frequency and presence penalties over the output's
    counts. A full forward per token: no cache to trust."""
    from transformers import (MinNewTokensLengthLogitsProcessor, RepetitionPenaltyLogitsProcessor,
                              SequenceBiasLogitsProcessor)

    ref = _model(str(model_dir))
    out = []
    with torch.no_grad():
        for p in prompts:
            processors = []
            if min_tokens and stop_ids:
                processors.append(MinNewTokensLengthLogitsProcessor(len(p), min_tokens, list(stop_ids)))
            if bias:
                processors.append(SequenceBiasLogitsProcessor([[[t], b] for t, b in bias.items()]))
            if repetition != 1:
                processors.append(RepetitionPenaltyLogitsProcessor(repetition, None if repetition_prompt else len(p)))
            tokens: list[int] = []
            while len(tokens) < new_tokens:
                ids = torch.tensor([p + tokens])
                scores = ref(ids).logits[:, -1].float()
                for word in bad_words:
                    if len(word) - 1 <= len(tokens) and list(word[:-1]) == tokens[len(tokens) - len(word) + 1:]:
                        scores[0, word[-1]] = float("-inf")
                for proc in processors:
                    scores = proc(ids, scores)
                counts = torch.bincount(torch.tensor(tokens, dtype=torch.long), minlength=scores.shape[-1]).float()
                scores = scores - frequency * counts - presence * (counts > 0).float()
                tokens.append(int(scores[0].argmax()))
            out.append(tokens)
    return out


@functools.lru_cache(maxsize=2)
def _model(model_dir: str):
    """The transformers model, loaded once for the several settings a test compares."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
