"""Tree verification in one target forward (engine.sample.tree): every node's logits over the
paged cache with the tree attention mask equal transformers' logits for the prompt followed
by that node's path; after the kept path is compacted into contiguous slots, the next decode
step's logits equal transformers' for the prompt and that path."""

import pytest
import torch

from atoll.config.engine import EngineConfig
from atoll.config.speculative import SpeculativeConfig
from atoll.engine.rank.run_spec import RunSpec
from atoll.engine.rank.runner import ModelRunner
from atoll.engine.sample.tree import compact, depths, path_slots, tree_mask, tree_meta
from atoll.layers.attention import AttentionMetadata
from atoll.errors import InputError
from atoll.parallel.mesh import ParallelContext

BLOCK = 4
PROMPT = [5, 17, 42, 9, 3, 77, 120]  # 7 tokens: the tree starts mid-block
# root (pending token); three children; node 1 has two, node 4 one, node 3 one
PARENTS = [-1, 0, 0, 0, 1, 1, 4, 3]
TOKENS = [200, 11, 12, 13, 21, 22, 31, 41]


def test_shape_helpers():
    assert depths(PARENTS) == [0, 1, 1, 1, 2, 2, 3, 2]
    mask = tree_mask(PARENTS)
    assert mask[6].nonzero().flatten().tolist() == [0, 1, 4, 6]
    assert mask[7].nonzero().flatten().tolist() == [0, 3, 7]
    assert path_slots(10, [1, 4, 6]) == [(14, 12), (16, 13)]
    assert path_slots(10, [1, 2]) == []
    with pytest.raises(ValueError, match=r"parents\[2\]=5"):
        depths([-1, 0, 5])


def _path(node):
    out = []
    while node > 0:
        out.append(node)
        node = PARENTS[node]
    return out[::-1]


@pytest.fixture(scope="module")
def model(tiny_model):
    d = tiny_model("llama")
    from transformers import AutoModelForCausalLM  # lazy: transformers is the reference only

    ref = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    runner = ModelRunner(RunSpec.of(str(d), "TP1", max_model_len=64, block_size=BLOCK, max_num_seqs=1),
                         ParallelContext.single())
    return runner, ref


def _ref_logits(ref, tokens):
    with torch.no_grad():
        return ref(torch.tensor([tokens])).logits[0, -1]


def test_one_forward_verifies_every_node_then_the_kept_path_decodes_on(model):
    runner, ref = model
    table = [9, 2, 6, 0]  # out of order: reads and moves must follow the table
    start = len(PROMPT)
    with torch.inference_mode():
        runner.model(torch.tensor(PROMPT), AttentionMetadata.build([table], [0], [start], BLOCK), runner.cache)
        logits = runner.model(torch.tensor(TOKENS), tree_meta(table, start, PARENTS, BLOCK), runner.cache)
    assert logits.shape[0] == len(PARENTS)
    for node in range(len(PARENTS)):
        want = _ref_logits(ref, PROMPT + [TOKENS[0]] + [TOKENS[n] for n in _path(node)])
        torch.testing.assert_close(logits[node], want, atol=1e-4, rtol=1e-4)
    # keep the deepest path (nodes 1, 4, 6): its keys move to slots start+1..start+3; decode on
    path = _path(6)
    compact(runner.cache, table, start, path, BLOCK)
    nxt = 250
    with torch.inference_mode():
        meta = AttentionMetadata.build([table], [start + 1 + len(path)], [1], BLOCK)
        got = runner.model(torch.tensor([nxt]), meta, runner.cache)[0]
    kept = PROMPT + [TOKENS[0]] + [TOKENS[n] for n in path] + [nxt]
    torch.testing.assert_close(got, _ref_logits(ref, kept), atol=1e-4, rtol=1e-4)
    # without the compaction the same step reads a sibling's keys and differs
    with torch.inference_mode():
        runner.model(torch.tensor(TOKENS), tree_meta(table, start, PARENTS, BLOCK), runner.cache)
        wrong = runner.model(torch.tensor([nxt]), AttentionMetadata.build([table], [start + 1 + len(path)], [1],
                                                                          BLOCK), runner.cache)[0]
    assert not torch.allclose(wrong, got, atol=1e-3)


@pytest.mark.parametrize("cfg, match", [
    ({"method": "ngram", "topk": 2}, "topk=2 .*goes with method eagle3 or deepseek_mtp, not ngram"),
    ({"method": "deepseek_mtp", "topk": 0}, "topk=0 must be a whole number of at least 1"),
    ({"method": "deepseek_mtp", "topk": True}, "topk=True must be a whole number")])
def test_bad_topk_refused_in_one_line(cfg, match):
    with pytest.raises(InputError, match=match):
        SpeculativeConfig.parse(cfg)
    assert SpeculativeConfig.parse({"method": "deepseek_mtp", "topk": 3}).topk == 3


def test_tree_drafts_over_a_quantized_kv_cache_are_refused_before_any_rank_starts():
    tree = {"method": "deepseek_mtp", "num_speculative_tokens": 2, "topk": 2}
    with pytest.raises(InputError, match="topk=2 \\(tree drafts\\) keeps its KV unquantized for now: not with "
                                         "kv_cache_dtype fp8"):
        EngineConfig(speculative_config=tree, kv_cache_dtype="fp8")
    assert EngineConfig(speculative_config=tree).speculative_config.topk == 2
    assert EngineConfig(speculative_config={**tree, "topk": 1}, kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
