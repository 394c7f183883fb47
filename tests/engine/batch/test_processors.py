"""Penalties, logit_bias, min_tokens and bad_words: greedy tokens equal to transformers' with
the same processors applied to its logits (tests/reference.py), at TP1, TP2 and PP2, in one
batch beside requests without any; under n-gram speculation the drafts are checked against
the processed distribution, so the tokens stay the same."""

import pytest
import torch
from reference import reference_processed, reference_tokens

from atoll import LLM, SamplingParams
from atoll.engine.sample.processors import ProcessorState, process_row
from atoll.errors import InputError

NEW = 10
STARTS = [[5, 7, 9, 11, 13, 5, 7, 9], [100, 3, 8, 100, 3], [42, 1, 2, 3, 4, 42, 1]]


def settings(base: list[list[int]]) -> dict:
    """name -> processor keywords (reference_processed's and SamplingParams' names), built from
    plain greedy's tokens so that each one changes them."""
    first, second, third = base[0][0], base[0][1], base[0][2]
    return {
        "penalties": dict(presence=0.6, frequency=0.4),
        "repetition": dict(repetition=1.3),
        "bias": dict(bias={first: -5.0, 250: 3.0}),
        "min_tokens": dict(min_tokens=3, stop_ids=(first, second, base[1][0])),
        "bad_words": dict(bad_words=((first,), (second, third), (base[2][0], base[2][1]))),
        "all": dict(presence=0.3, frequency=0.2, repetition=1.2, bias={first: -2.0, 17: 2.5}, min_tokens=2,
                    stop_ids=(second,), bad_words=((third,),)),
    }


def params_of(kw: dict) -> SamplingParams:
    return SamplingParams(max_tokens=NEW, ignore_eos=True, presence_penalty=kw.get("presence", 0.0),
                          frequency_penalty=kw.get("frequency", 0.0), repetition_penalty=kw.get("repetition", 1.0),
                          logit_bias=kw.get("bias"), min_tokens=kw.get("min_tokens", 0),
                          stop_token_ids=kw.get("stop_ids", ()), bad_words_token_ids=kw.get("bad_words", ()))


def until_stop(tokens: list[int], kw: dict) -> list[int]:
    """The reference cut where the request stops: its first stop token at or past min_tokens."""
    for i, t in enumerate(tokens):
        if t in kw.get("stop_ids", ()) and i >= kw.get("min_tokens", 0):
            return tokens[:i + 1]
    return tokens


@pytest.fixture(scope="module")
def expected(tiny_model):
    """(model dir, prompts, plain greedy tokens, {setting: (keywords, reference tokens per
    prompt)}). Each prompt ends with the two tokens greedy continues it with, so the tokens
    the model likes are in the prompt, where repetition_penalty reads them."""
    d = tiny_model("llama", num_hidden_layers=2)
    prompts = [p + b[:2] for p, b in zip(STARTS, reference_tokens(d, STARTS, 2))]
    base = reference_tokens(d, prompts, NEW)
    out = {}
    for name, kw in settings(base).items():
        ref = reference_processed(d, prompts, NEW, **kw)
        assert ref != base, name  # the setting changes greedy's tokens, so a processor left out shows
        out[name] = (kw, [until_stop(r, kw) for r in ref])
    # the prompt's tokens count for repetition_penalty: leaving them out would show
    assert out["repetition"][1] != reference_processed(d, prompts, NEW, repetition=1.3, repetition_prompt=False)
    return d, prompts, base, out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["TP1", "TP2", "PP2"])
def test_processed_greedy_matches_transformers(expected, layout):
    d, prompts, base, cases = expected
    batch, params, want = list(prompts), [SamplingParams(max_tokens=NEW, ignore_eos=True)] * len(prompts), list(base)
    for kw, ref in cases.values():
        batch += prompts
        params += [params_of(kw)] * len(prompts)
        want += ref
    with LLM(d, layout=layout) as llm:
        outs = llm.generate(batch, params)
    got = [o.token_ids for o in outs]
    names = ["plain"] * len(prompts) + [n for n in cases for _ in prompts]
    for name, g, w in zip(names, got, want):
        assert g == w, name


@pytest.mark.timeout(300)
def test_speculative_drafts_are_checked_against_the_processed_logits(expected):
    """A negative frequency penalty makes the model repeat itself, so n-gram drafts are taken;
    each drafted row is processed as if the drafts before it had been generated."""
    d, prompts, _, _ = expected
    repeated = reference_processed(d, prompts, 1, frequency=-1.0)
    # a word of the token the model repeats, twice: masked after it where drafts put it too
    kw = dict(frequency=-1.0, bias={17: 1.5}, bad_words=tuple((r[0], r[0]) for r in repeated))
    want = reference_processed(d, prompts, NEW, **kw)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2}
    with LLM(d, layout="TP1", speculative_config=spec) as llm:
        outs = llm.generate(prompts, params_of(kw))
    assert [o.token_ids for o in outs] == want
    assert sum(o.metrics["spec_accepted"] for o in outs) > 0  # drafts were verified, and kept


def test_bad_words_mask_the_last_token_after_its_prefix():
    params = SamplingParams(bad_words_token_ids=((3,), (5, 6, 7)))
    state = ProcessorState(params, [1, 2], "cpu")
    for output, extra, masked in [([], [], {3}), ([5], [], {3}), ([5, 6], [], {3, 7}), ([5], [6], {3, 7}),
                                  ([6], [], {3})]:
        row = torch.zeros(10)
        process_row(row, state, output, extra)
        assert set(torch.nonzero(row == float("-inf")).flatten().tolist()) == masked, (output, extra)


def test_penalties_count_drafts_without_keeping_them():
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25, repetition_penalty=2.0)
    state = ProcessorState(params, [4], "cpu")
    row = torch.tensor([1.0, -1.0, 2.0, 0.0, 3.0])
    process_row(row, state, [0, 0], [1])  # 0 twice out, 1 drafted once, 4 in the prompt
    assert row.tolist() == pytest.approx([1.0 / 2 - 0.5 * 2 - 0.25, -1.0 * 2 - 0.5 - 0.25, 2.0, 0.0, 3.0 / 2])
    row = torch.tensor([1.0, -1.0, 2.0, 0.0, 3.0])
    process_row(row, state, [0, 0])  # the draft left no trace
    assert row.tolist() == pytest.approx([1.0 / 2 - 0.5 * 2 - 0.25, -1.0, 2.0, 0.0, 3.0 / 2])


def test_min_tokens_masks_the_stop_tokens_until_then():
    state = ProcessorState(SamplingParams(max_tokens=8, min_tokens=2, stop_token_ids=(1, 3)), [0], "cpu")
    for output, masked in [([], True), ([4], True), ([4, 4], False)]:
        row = torch.zeros(5)
        process_row(row, state, output)
        assert (row[[1, 3]] == float("-inf")).all().item() is masked


@pytest.mark.parametrize("kwargs,text", [
    (dict(presence_penalty=-2.5), "presence_penalty=-2.5 must be in [-2, 2]"),
    (dict(frequency_penalty=3), "frequency_penalty=3.0 must be in [-2, 2]"),
    (dict(repetition_penalty=0), "repetition_penalty=0.0 must be greater than 0"),
    (dict(logit_bias={"x": 1}), "key 'x' is not a token id"),
    (dict(logit_bias={3: 101}), "the bias of token 3 is 101"),
    (dict(min_tokens=5, max_tokens=4), "min_tokens=5 must be at most max_tokens=4"),
    (dict(n=2), "n=2 needs temperature > 0"),
    (dict(n=0, temperature=1), "n=0 must be between 1 and 128"),
    (dict(bad_words_token_ids=[[]]), "bad_words_token_ids[0]=[] must be a non-empty list"),
    (dict(prompt_logprobs=21), "prompt_logprobs=21"),
])
def test_bad_sampling_params_name_the_field(kwargs, text):
    with pytest.raises(InputError) as e:
        SamplingParams(**kwargs)
    assert text in str(e.value)
