"""The built-in EAGLE-3 training prompts (cli/spec_prompts.py) are many, distinct, and held apart
from `atoll bench spec --prompts chat` (the held-out set): no prompt of it, and no topic that
shares a word with it."""

import re

from atoll.bench.spec import CHAT
from atoll.cli.spec_prompts import TOPICS, builtin_prompts

STOP = {"a", "an", "the", "of", "to", "is", "are", "what", "how", "do", "i", "me", "some", "that", "in", "for",
        "give", "about", "write", "explain", "why", "name"}


def _words(text: str) -> set[str]:
    return {w for w in re.findall(r"[a-z]+", text.lower()) if w not in STOP}


def test_prompts_many_and_distinct():
    texts = builtin_prompts()
    assert len(texts) >= 2000 and len(set(texts)) == len(texts)
    assert builtin_prompts() == texts  # one fixed order
    assert len({t.split()[0] for t in texts[:48]}) > 4  # the first few already mix the forms


def test_prompts_disjoint_from_bench_chat():
    held_out = {w for prompt in CHAT for w in _words(prompt)}
    assert not set(builtin_prompts()) & set(CHAT)
    clashes = [t for t in TOPICS if _words(t) & held_out]
    assert not clashes, f"topics sharing a word with the chat prompts: {clashes}"
