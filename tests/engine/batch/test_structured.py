"""Structured outputs in the engine (LLM and SamplingParams), on SmolLM2-135M-Instruct's real
tokenizer: where the model's greedy answer already fits the grammar, the constrained answer is
token-identical to it at TP3 (its 9 heads take no TP2) and PP2, and at TP2 on a tiny Llama with
its tokenizer; n-gram speculation under a JSON schema gives the same tokens as without
speculation, valid under the schema, with drafts taken; the compiled grammars are cached by their
canonical text, within a bound; a bad one is refused naming the field."""

import json
import re
import subprocess
import sys

import jsonschema
import pytest

from atoll import LLM, SamplingParams
from atoll.config.structured import StructuredOutputs
from atoll.engine.sample import grammar as grammar_mod
from atoll.engine.sample.grammar import Grammars
from atoll.errors import InputError

QUESTIONS = ["What is the capital of France?", "Name one primary color.", "How many legs does a cat have?"]
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 16},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 120}},
          "required": ["name", "age"], "additionalProperties": False}


def char_class(text: str) -> str:
    """A regex of one or more of the text's own characters (Rust regex syntax)."""
    return "[" + "".join("\\" + c if c in "\\]^-[&~" else c for c in sorted(set(text))) + "]+"


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", [pytest.param("TP3", marks=pytest.mark.slow), "PP2"])  # SmolLM2 has 9 heads: TP3, not TP2
def test_constrained_greedy_is_token_identical_where_the_answer_fits(smollm2_dir, layout):
    with LLM(smollm2_dir, layout=layout, max_model_len=256) as llm:
        free = llm.generate(QUESTIONS, SamplingParams(max_tokens=24), chat=True)
        fits = [SamplingParams(max_tokens=24, structured_outputs={"regex": char_class(o.text)}) for o in free]
        fits += [SamplingParams(max_tokens=24, structured_outputs={"choice": ["No.", o.text, "Yes, 42."]})
                 for o in free]
        bent = [SamplingParams(max_tokens=24, structured_outputs={"choice": ["Berlin", "Blue"]}),
                SamplingParams(max_tokens=40, structured_outputs={"json": PERSON})]
        outs = llm.generate(QUESTIONS * 2 + ["What is the capital of France?", "Describe a person as JSON."],
                            fits + bent, chat=True)
    assert all(o.text for o in free)
    for o, want in zip(outs[:6], free * 2):
        assert o.token_ids == want.token_ids, (layout, o.text, want.text)
    # the same path changes what does not fit: the mask acts
    assert outs[6].text in ("Berlin", "Blue") and outs[6].text != free[0].text
    assert outs[7].finish_reason == "stop"
    jsonschema.validate(json.loads(outs[7].text), PERSON)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_ngram_speculation_under_a_schema_keeps_the_tokens_and_takes_drafts(smollm2_dir):
    """Drafts are checked against the grammar (a draft the grammar refuses is masked at its
    position) and the matcher rolls back past the rejected ones: the tokens equal those of the
    same grammar without speculation."""
    # each with a key the schema refuses: the n-gram drafts propose it, the grammar masks it
    people = [{"name": "Ada", "age": 36, "city": "London"}, {"name": "Alan", "age": 41, "city": "Wilmslow"},
              {"name": "Grace", "age": 85, "city": "Arlington"}]
    prompts = [f"Repeat this JSON exactly: {json.dumps(p)}\nAgain: {json.dumps(p)}" for p in people]
    constrained = SamplingParams(max_tokens=40, structured_outputs={"json": PERSON})
    free = SamplingParams(max_tokens=40)
    with LLM(smollm2_dir, layout="TP1", max_model_len=256) as llm:
        plain = llm.generate(prompts, constrained, chat=True)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    with LLM(smollm2_dir, layout="TP1", max_model_len=256, speculative_config=spec) as llm:
        outs = llm.generate(prompts * 2, [constrained] * 3 + [free] * 3, chat=True)
    for o, want in zip(outs[:3], plain):
        assert o.token_ids == want.token_ids, (o.text, want.text)
        jsonschema.validate(json.loads(o.text), PERSON)
    drafted = sum(o.metrics["spec_drafted"] for o in outs[:3])
    accepted = sum(o.metrics["spec_accepted"] for o in outs[:3])
    free_drafted = sum(o.metrics["spec_drafted"] for o in outs[3:])
    free_accepted = sum(o.metrics["spec_accepted"] for o in outs[3:])
    print(f"acceptance: schema {accepted}/{drafted}, unconstrained {free_accepted}/{free_drafted}")
    assert accepted > 0 and drafted > accepted  # drafts taken, and some refused or rejected


def test_grammars_are_cached_by_canonical_text_within_a_bound(smollm2_dir, monkeypatch):
    g = Grammars(smollm2_dir, 49152, None)
    a = StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "integer"}}})
    b = StructuredOutputs(json=json.dumps({"properties": {"a": {"type": "integer"}}, "type": "object"}, indent=2))
    assert a.key == b.key
    g.check(a)
    m1, m2 = g.state(b), g.state(a)
    assert g.compiled == 1 and m1.matcher is not m2.matcher  # one compile; each request its own copy
    monkeypatch.setattr(grammar_mod, "MAX_CACHED", 3)
    for word in ("x", "y", "z", "w"):
        g.check(StructuredOutputs(choice=[word]))
    assert g.compiled == 5 and len(g._cache) == 3
    g.check(a)  # evicted (least recently used): compiled again
    assert g.compiled == 6


def test_bad_grammars_name_their_field(smollm2_dir):
    g = Grammars(smollm2_dir, 49152, None)
    cases = [(StructuredOutputs(regex="a(b"), "structured_outputs.regex: invalid regex"),
             (StructuredOutputs(grammar="start: nothing_here"), "structured_outputs.grammar: invalid grammar"),
             (StructuredOutputs(json={"type": "nope"}), "structured_outputs.json: invalid json"),
             (StructuredOutputs(json={"type": "nope"}, source="response_format"), "response_format: invalid json")]
    for so, start in cases:
        with pytest.raises(InputError) as e:
            g.check(so)
        assert str(e.value).startswith(start) and "\n" not in str(e.value), str(e.value)
    with pytest.raises(InputError, match=re.escape("structured_outputs={json, regex}: give exactly one")):
        SamplingParams(structured_outputs={"json": {}, "regex": "a"})
    with pytest.raises(InputError, match="structured_outputs.pattern is not supported"):
        SamplingParams(structured_outputs={"pattern": "a"})


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_generate_request_lines_take_structured_outputs(smollm2_dir, tmp_path):
    """`atoll generate`'s request lines take the same object; a bad regex is that line's error."""
    lines = [{"id": "pick", "prompt": "The sky is", "max_tokens": 8, "structured_outputs": {"choice": ["blue", "red"]}},
             {"id": "json", "prompt": "A person:", "max_tokens": 40, "structured_outputs": {"json": PERSON}},
             {"id": "bad", "prompt": "x", "structured_outputs": {"regex": "a(b"}}]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    run = subprocess.run([sys.executable, "-m", "atoll", "generate", "--model", str(smollm2_dir), "--prompts",
                          str(path), "--no-progress"], capture_output=True, text=True, timeout=280)
    out = {r["id"]: r for r in map(json.loads, run.stdout.splitlines())}
    assert out["pick"]["text"] in ("blue", "red"), run.stderr[-2000:]
    jsonschema.validate(json.loads(out["json"]["text"]), PERSON)
    assert out["bad"]["error"].startswith("line 3: structured_outputs.regex: invalid regex")


@pytest.mark.timeout(600)
def test_constrained_greedy_is_token_identical_at_tp2(tiny_model, smollm2_dir, tmp_path):
    """TP2, which SmolLM2's 9 heads do not take: a tiny random Llama (4 heads) with SmolLM2's
    tokenizer. Its greedy text is whatever its random weights say; grammars built to admit it
    (its own characters, a choice holding it) leave every token as it was, over the sampling
    rank's mask and the TP2 step."""
    import shutil

    model = tmp_path / "tiny-with-tokenizer"
    shutil.copytree(tiny_model("llama", vocab_size=49152), model)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        if (smollm2_dir / name).exists():
            shutil.copy(smollm2_dir / name, model / name)
    prompts = ["The capital of France is", "Colors: red, green,", "One, two, three,"]
    with LLM(model, layout="TP2", max_model_len=128) as llm:
        free = llm.generate(prompts, SamplingParams(max_tokens=12))
        fits = [SamplingParams(max_tokens=12, structured_outputs={"choice": ["No.", o.text]}) for o in free]
        fits += [SamplingParams(max_tokens=12, structured_outputs={"regex": char_class(o.text)}) for o in free]
        outs = llm.generate(prompts * 2, fits)
        bent = llm.generate(prompts[:1], SamplingParams(max_tokens=12, structured_outputs={"choice": ["Paris"]}))
    # a grammar admits the text only if it decodes whole: keep the prompts whose text does
    kept = [i for i, o in enumerate(free) if o.text and "\ufffd" not in o.text]
    assert len(kept) >= 2, [o.text for o in free]
    for i in kept:
        assert outs[i].token_ids == free[i].token_ids, (outs[i].text, free[i].text)
        assert outs[len(prompts) + i].token_ids == free[i].token_ids, (outs[len(prompts) + i].text, free[i].text)
    assert bent[0].text == "Paris"  # the mask acts at TP2 too
