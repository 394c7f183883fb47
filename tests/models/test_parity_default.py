"""The default CPU path against transformers at TP1, TP2 and PP2: no --enforce-eager, the
compile policy left at auto, so a job of this length decodes eagerly with its products tuned
for this CPU (engine.rank.tuning.tune_eager: oneDNN-packed weights where they measure faster).
The compiled step, which auto takes above its threshold, has its parity at the same layouts in
tests/engine/step/test_compiled.py."""

import pytest

from reference import reference_tokens

from atoll import LLM, SamplingParams
from atoll.layers import packed

PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8], [250]]
NEW = packed.TUNE_MIN_STEPS + 4  # long enough that the eager step tunes its products


@pytest.fixture(scope="module")
def model_and_reference(tiny_model):
    d = tiny_model("llama", num_hidden_layers=4)
    return d, reference_tokens(d, PROMPTS, NEW)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["TP1", "TP2", "PP2"])
def test_default_path_matches_transformers(model_and_reference, monkeypatch, tmp_path, capfd, layout):
    monkeypatch.delenv("ATOLL_ENFORCE_EAGER", raising=False)
    monkeypatch.delenv("ATOLL_COMPILE", raising=False)  # the suite's never: auto, the default
    monkeypatch.setenv("ATOLL_CACHE", str(tmp_path))  # no record of earlier runs: the policy's estimate
    model_dir, expected = model_and_reference
    outs = LLM(model_dir, layout=layout).generate(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    assert [o.token_ids for o in outs] == expected
    err = capfd.readouterr().err
    if packed.onednn_can_pack():  # the tuning ran (what it packs depends on this CPU)
        assert "weights packed for oneDNN" in err, err[-2000:]
    assert "compiled the decode step" not in err  # a job this short stays eager under auto
