"""A request's token-id parameters checked against the model before any rank sees them:
logit_bias and bad words within the vocabulary, and bad words given as text tokenized as vLLM
tokenizes them (SamplingParams knows no vocabulary; engine/sample/processors.py indexes the
logits with these ids, so an id past the vocabulary would fail on a rank)."""

from __future__ import annotations

from dataclasses import replace

from atoll.config.sampling import SamplingParams
from atoll.errors import InputError


def token_params(p: SamplingParams, *, vocab_size: int, tokenizer, model_dir, grammars=None) -> SamplingParams:
    """The params with their bad words tokenized, their token ids checked and their structured
    outputs' grammar compiled (`grammars`, engine.sample.grammar: cached for the ranks' own
    compile of the same); InputError naming the field. Each bad word is encoded as given and with a leading space (vLLM: so a
    word is masked at the start of the text and inside it), the second kept where it gives
    other tokens of the same count."""
    if p.structured_outputs is not None:
        if grammars is None or tokenizer is None:
            raise InputError(f"{p.structured_outputs.field}: {model_dir} has no tokenizer.json, which grammars need")
        grammars.check(p.structured_outputs)
    for token in p.logit_bias or {}:
        if token >= vocab_size:
            raise InputError(f"logit_bias: token {token} is outside the vocabulary: token ids are 0..{vocab_size - 1}")
    words = list(p.bad_words_token_ids)
    if p.bad_words:
        if tokenizer is None:
            raise InputError(f"bad_words: {model_dir} has no tokenizer.json; give bad_words_token_ids")
        for word in p.bad_words:
            plain = None
            for space in ("", " "):
                ids = tuple(tokenizer.encode(space + word.lstrip(), add_special_tokens=False))
                if not ids and not space:
                    raise InputError(f"bad_words: {word!r} encodes to no tokens")
                if ids and (plain is None or (ids[0] != plain[0] and len(ids) == len(plain))):
                    words.append(ids)
                    plain = plain or ids
    for word in words:
        if any(t >= vocab_size for t in word):
            raise InputError(f"bad_words: {list(word)} holds a token outside the vocabulary (0..{vocab_size - 1})")
    if words != list(p.bad_words_token_ids):
        p = replace(p, bad_words_token_ids=tuple(dict.fromkeys(words)))
    return p
