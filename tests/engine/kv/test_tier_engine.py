"""The KV cache tiers under the engine (engine/rank/kv_tiers.py): a prefix the device pool let
go of comes back from host memory or disk with the tokens of computing it, a restart on the same
disk directory starts warm, and a damaged or foreign block is a miss, never data."""

import os
from pathlib import Path

import pytest

from atoll import LLM, SamplingParams
from reference import reference_tokens
from redis_server import server  # noqa: F401  (the redis-server fixture)

NEW = 6


def _prompts(vocab: int, convs: int = 8) -> tuple[list, list]:
    """Turn 1: `convs` prompts of 40 tokens; turn 2: each with 20 more (its first two blocks
    computed by turn 1)."""
    first = [[(97 * c + 31 * j) % (vocab - 10) + 5 for j in range(40)] for c in range(convs)]
    second = [p + [(13 * c + 7 * j) % (vocab - 10) + 5 for j in range(20)] for c, p in enumerate(first)]
    return first, second


def _serve(model, prompts, **kw) -> list:
    """Each prompt alone, in order, on one living engine whose pool holds one conversation's worth."""
    with LLM(str(model), max_model_len=128, num_blocks=8, max_num_seqs=1, **kw) as llm:
        return [llm.generate([p], SamplingParams(max_tokens=NEW, ignore_eos=True))[0] for p in prompts]


@pytest.mark.parametrize("layout", ["TP1", "TP2", "PP2"])
def test_prefixes_come_back_from_the_tiers_with_the_tokens_of_computing_them(tiny_model, tmp_path, layout):
    model = tiny_model("llama")
    first, second = _prompts(256)
    outs = _serve(model, first + second, layout=layout, kv_offload_gb=0.01, kv_disk_dir=str(tmp_path / "kv"))
    assert [o.token_ids for o in outs] == reference_tokens(model, first + second, NEW)
    # the pool holds 8 blocks: every turn-2 prompt finds its first two blocks below it
    assert [o.metrics["cached_tokens"] for o in outs[len(first):]] == [32] * len(second)
    if layout == "TP1":  # without tiers most of them are computed again
        plain = _serve(model, first + second, layout=layout)
        assert sum(o.metrics["cached_tokens"] for o in plain[len(first):]) < 32 * len(second) // 2
        assert [o.token_ids for o in plain] == [o.token_ids for o in outs]


def test_a_restart_on_the_same_disk_directory_starts_warm(tiny_model, tmp_path):
    model = tiny_model("llama")
    first, second = _prompts(256, convs=3)
    kv = str(tmp_path / "kv")
    before = _serve(model, first, kv_disk_dir=kv)
    assert [o.metrics["cached_tokens"] for o in before] == [0, 0, 0]
    after = _serve(model, second, kv_disk_dir=kv)  # a new engine: its device pool is empty
    assert [o.metrics["cached_tokens"] for o in after] == [32, 32, 32]
    assert [o.token_ids for o in after] == reference_tokens(model, second, NEW)


def test_a_corrupt_truncated_or_foreign_block_is_a_miss_and_the_tokens_hold(tiny_model, tmp_path):
    model, other = tiny_model("llama"), tiny_model("llama", seed=7)
    first, second = _prompts(256, convs=3)
    kv, theirs = tmp_path / "kv", tmp_path / "theirs"
    _serve(model, first, kv_disk_dir=str(kv))
    _serve(other, first, kv_disk_dir=str(theirs))
    files = sorted(p for p in kv.rglob("*") if p.is_file() and not p.name.startswith("."))
    assert len(files) >= 6  # two named prompt blocks a conversation (and decode blocks)
    by_name = {p.name: p for p in theirs.rglob("*") if p.is_file()}
    # conversation k's first block: damaged three ways (each conversation's own first block)
    firsts = [_first_block(kv, p, model) for p in first]
    data = firsts[0].read_bytes()
    firsts[0].write_bytes(data[:-40] + bytes(b ^ 0xFF for b in data[-40:]))  # corrupt
    firsts[1].write_bytes(firsts[1].read_bytes()[:100])  # truncated
    foreign = [p for n, p in by_name.items() if n[-32:] == firsts[2].name[-32:]]
    assert foreign, "the other model's engine wrote the same block name"
    firsts[2].write_bytes(foreign[0].read_bytes())  # another model's block under this one's file
    after = _serve(model, second, kv_disk_dir=str(kv))
    assert [o.metrics["cached_tokens"] for o in after] == [0, 0, 0]  # each walk stops at its first block
    assert [o.token_ids for o in after] == reference_tokens(model, second, NEW)


def _first_block(kv: Path, prompt: list, model) -> Path:
    """The disk file of a prompt's first block (its name ends the file name)."""
    from atoll.engine.kv.blocks import prefix_names

    key = prefix_names(prompt, 16, 1)[0].hex()
    found = [p for p in kv.rglob("*") if p.is_file() and p.name.endswith(key)]
    assert len(found) == 1, (key, os.listdir(kv))
    return found[0]


def test_replicas_share_prefixes_through_redis_and_serve_on_when_it_dies(tiny_model, server):
    """Two engines at once (two replicas, or two servers): what A computed, B finds in Redis.
    Then Redis dies: serving goes on from the local tiers, no request failing."""
    url, proc = server
    model = tiny_model("llama")
    first, second = _prompts(256, convs=2)
    ref = reference_tokens(model, first + second, NEW)
    params = SamplingParams(max_tokens=NEW, ignore_eos=True)
    kw = dict(max_model_len=128, num_blocks=8, max_num_seqs=1, kv_shared=url)
    with LLM(str(model), **kw) as a, LLM(str(model), **kw) as b:
        one = a.generate([first[0]], params)[0]
        two = b.generate([second[0]], params)[0]  # b's pool never saw the prefix
    assert (one.token_ids, two.token_ids) == (ref[0], ref[2])
    assert (one.metrics["cached_tokens"], two.metrics["cached_tokens"]) == (0, 32)
    proc.kill()
    proc.wait(timeout=10)
    after = _serve(model, [first[1], second[1]], kv_shared=url, kv_offload_gb=0.01)
    assert [o.token_ids for o in after] == [ref[1], ref[3]] and all(o.error is None for o in after)
    assert after[1].metrics["cached_tokens"] == 32  # from host memory, with Redis gone


@pytest.mark.parametrize("kind,kv_dtype", [("llama", "int8"), ("llama", "fp8"), ("deepseek_v3", "auto"),
                                           ("mistral", "auto")])
def test_quantized_latent_and_windowed_caches_come_back_as_stored(tiny_model, tmp_path, kind, kv_dtype):
    """int8 and fp8 blocks (with their scales), MLA's latent rows and a sliding-window model's
    blocks: the tokens with tiers are those without (the same cache dtype), and every turn-2
    prompt finds its two blocks below the pool."""
    model = tiny_model(kind, **({"sliding_window": 32} if kind == "mistral" else {}))
    first, second = _prompts(256, convs=6)
    kw = dict(kv_cache_dtype=kv_dtype)
    tiers = _serve(model, first + second, kv_offload_gb=0.01, **kw)
    plain = _serve(model, first + second, **kw)
    assert [o.token_ids for o in tiers] == [o.token_ids for o in plain]
    assert [o.metrics["cached_tokens"] for o in tiers[len(first):]] == [32] * len(second)
