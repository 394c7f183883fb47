"""A disaggregated engine over a shared KV store (--kv-shared): the prefill engine writes the
blocks it computes to the store, so a later prompt with that prefix, whose blocks its decode
replica's pool has let go of, is prefilled on the decode engine from the store instead of going
back to a prefill engine; tokens equal to transformers'. And each engine of a job, or each
replica, keeps its own --kv-disk-dir subdirectory."""

import pytest
from reference import reference_tokens

from atoll import LLM, SamplingParams

NEW = 6
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)


def _prompt(seed: int, n: int = 40) -> list[int]:
    return [(97 * seed + 31 * j) % 240 + 5 for j in range(n)]


@pytest.mark.timeout(300)
def test_the_decode_engine_reads_a_known_prefix_from_the_shared_store(tiny_model, tmp_path):
    model = tiny_model("llama")
    first, others = _prompt(1), [_prompt(s) for s in (2, 3, 4)]
    again = first + _prompt(9, 4)  # 44 tokens: two full blocks named by the first, 12 new
    want = reference_tokens(model, [first, *others, again], NEW)
    shared = f"file://{tmp_path / 'store'}"
    # 8 blocks of 16 on the decode engine: three more 46-token sequences push the first one's out
    with LLM(str(model), prefill="TP1", decode="TP1", num_blocks=8, max_num_seqs=1, max_model_len=128,
             disagg_min_prompt_tokens=13, kv_shared=shared, kv_disk_dir=str(tmp_path / "disk")) as llm:
        outs = [llm.generate([p], GREEDY, timeout_s=120)[0] for p in [first, *others, again]]
        routed = dict(llm.start().routed)
    assert [o.token_ids for o in outs] == want
    assert [o.metrics["prefilled_on"] for o in outs] == ["prefill"] * 4 + ["decode"]
    assert routed["decode"] == 1
    assert outs[-1].metrics["cached_tokens"] == 32  # read from the store, not computed
    # each engine kept its own disk directory (a disk tier's directory is one engine's alone)
    assert sorted(p.name for p in (tmp_path / "disk").iterdir()) == ["decode0", "prefill0"]


@pytest.mark.timeout(300)
def test_without_the_store_the_same_prompt_goes_back_to_a_prefill_engine(tiny_model):
    model = tiny_model("llama")
    first, others = _prompt(1), [_prompt(s) for s in (2, 3, 4)]
    again = first + _prompt(9, 4)
    with LLM(str(model), prefill="TP1", decode="TP1", num_blocks=8, max_num_seqs=1, max_model_len=128,
             disagg_min_prompt_tokens=13) as llm:
        outs = [llm.generate([p], GREEDY, timeout_s=120)[0] for p in [first, *others, again]]
    assert [o.metrics["prefilled_on"] for o in outs] == ["prefill"] * 5
