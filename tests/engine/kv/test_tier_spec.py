"""The KV cache tiers with n-gram speculation: a verify step writes the KV of every drafted token
into the sequence's blocks, and the rejected ones' stay there until the real tokens overwrite
them. The scheduler names a block only once its real tokens fill it (Scheduler.commit), and only
named blocks are written through to the tiers, so no tier ever holds a rejected draft's KV.

The workload: conversations whose prompts repeat themselves (the n-gram drafter finds
something, and the random model rejects much of it), served one at a time through an 8-block
pool. Turn 1 generates 24 tokens, so each conversation's third block is filled by verify steps;
turn 2 continues the conversation (its prompt, the reply, 12 new tokens) and finds those three
blocks below the pool. The same two turns without speculation store the same blocks: each
record holds the same bytes (up to the float rounding of a different step shape)."""

from pathlib import Path

import numpy as np
import pytest

from atoll import LLM, SamplingParams
from atoll.engine.kv.tiers.record import HEADER
from reference import reference_tokens

NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3}
CONVS, NEW1, NEW2 = 4, 24, 6


def _first() -> list[list[int]]:
    """Turn 1: 40 tokens a conversation, a run of 7 repeated (n-gram drafts to propose)."""
    return [[(11 * c + 3 * (j % 7)) % 250 + 5 for j in range(40)] for c in range(CONVS)]


def _second(first: list, replies: list) -> list[list[int]]:
    return [p + r + [(13 * c + 7 * j) % 250 + 5 for j in range(12)] for c, (p, r) in enumerate(zip(first, replies))]


def _two_turns(model, kv: Path, layout: str, **kw):
    """Both turns on one living engine, each prompt alone; (turn 1 outputs, turn 2 prompts,
    turn 2 outputs, the engine's stats)."""
    first = _first()
    with LLM(str(model), layout=layout, max_model_len=128, num_blocks=8, max_num_seqs=1, kv_offload_gb=0.01,
             kv_disk_dir=str(kv), **kw) as llm:
        one = [llm.generate([p], SamplingParams(max_tokens=NEW1, ignore_eos=True))[0] for p in first]
        second = _second(first, [o.token_ids for o in one])
        two = [llm.generate([p], SamplingParams(max_tokens=NEW2, ignore_eos=True))[0] for p in second]
        return one, second, two, dict(llm.start().stats)


def _records(kv: Path) -> dict[tuple, np.ndarray]:
    """Every block record on disk: {(rank folder, block name): its payload as float32}."""
    out = {}
    for p in kv.rglob("*"):
        if p.is_file() and not p.name.startswith("."):
            payload = p.read_bytes()[HEADER.size:]
            rank = p.relative_to(kv).parts[0] if len(p.relative_to(kv).parts) == 3 else ""  # rankN/xx/file
            out[(rank, p.name[32:])] = np.frombuffer(payload, dtype=np.float32)
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["TP1", "TP2"])
def test_a_rejected_draft_never_reaches_a_tier(tiny_model, tmp_path, layout):
    model = tiny_model("llama", num_hidden_layers=4)
    one, second, two, stats = _two_turns(model, tmp_path / "spec", layout, speculative_config=NGRAM)
    p_one, p_second, p_two, _ = _two_turns(model, tmp_path / "plain", layout)
    # transformers' tokens, turn 2 continuing what turn 1 said (with speculation and without)
    ref1 = reference_tokens(model, _first(), NEW1)
    assert [o.token_ids for o in one] == [o.token_ids for o in p_one] == ref1
    assert second == p_second == _second(_first(), ref1)
    assert [o.token_ids for o in two] == [o.token_ids for o in p_two] == reference_tokens(model, second, NEW2)
    metrics = [o.metrics for o in one + two]
    drafted, accepted = sum(m["spec_drafted"] for m in metrics), sum(m["spec_accepted"] for m in metrics)
    assert 0 < accepted < drafted, (accepted, drafted)  # drafts were proposed, and some rejected
    # every turn-2 prompt found its three blocks (the third one filled by verify steps) below the pool
    assert [o.metrics["cached_tokens"] for o in two] == [48] * CONVS
    assert stats["kv_tier_host_hits"] == 3 * CONVS and stats["kv_tier_checksum_misses"] == 0, stats
    # the same blocks stored under the same names as without speculation, holding the same KV:
    # a block saved with a rejected draft's KV in it differs there by far more than rounding
    spec, plain = _records(tmp_path / "spec"), _records(tmp_path / "plain")
    ranks = 2 if layout == "TP2" else 1
    assert len(spec) == 5 * CONVS * ranks  # turn 1: 3 blocks a conversation; turn 2: 2 more
    assert spec.keys() == plain.keys()
    off = {k: float(np.abs(spec[k] - plain[k]).max()) for k in spec}
    assert max(off.values()) < 1e-3, sorted(off.items(), key=lambda kv: -kv[1])[:3]
