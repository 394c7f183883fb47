"""atoll bench spec: speculation off and on side by side (a smoke run on the real model, and
the table's lines)."""

import json

import cli
import pytest

from atoll.bench.spec import render, side_names
from atoll.config.speculative import SpeculativeConfig


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_bench_spec_smoke_on_copy_prompts(capsys, smollm2_dir):
    code, out, err = cli.run_cli(capsys, "bench", "spec", "--model", str(smollm2_dir), "--speculative-config",
                                 '{"method": "ngram", "num_speculative_tokens": 3}', "--requests", "2",
                                 "--output-len", "24", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["tokens_identical"] is True and r["requests"] == 2 and r["output_len"] == 24
    on, off = r["on"], r["off"]
    # the model copies the given text, so n-gram drafts are made and mostly kept
    assert on["drafted"] > 0 and 0 < on["acceptance_rate"] <= 1 and on["mean_accepted_length"] > 1
    assert r["speedup"] == pytest.approx(on["tok_s"] / off["tok_s"], rel=1e-6)


def test_render_says_when_no_draft_was_made():
    side = {"tok_s": 10.0, "total_s": 1.0, "load_avg_1m": [1.0]}
    r = {"model": "m", "layout": "TP1", "device": "cpu", "prompts": "copy", "batch": 16, "requests": 16,
         "output_len": 8, "rounds": 1, "speculative_config": "{}", "speedup": 1.0, "tokens_identical": True,
         "off": side, "on": side | {"drafted": 0, "acceptance_rate": 0.0, "mean_accepted_length": 0.0}}
    assert "no drafts made" in render(r)
    r["on"] |= {"drafted": 12, "acceptance_rate": 0.5, "mean_accepted_length": 2.5}
    assert "acceptance 50.0%, mean accepted length 2.50" in render(r)


def test_several_sides_named_and_rendered():
    configs = [SpeculativeConfig.parse(c) for c in ('{"method": "lookahead"}', '{"method": "ngram"}',
                                                    '{"method": "ngram", "min_acceptance_rate": 0.2}')]
    assert side_names(configs) == ["lookahead", "ngram1", "ngram2"]
    assert side_names(configs[:1]) == ["on"]
    side = {"tok_s": 10.0, "total_s": 1.0, "load_avg_1m": [1.0]}
    r = {"model": "m", "layout": "TP1", "device": "cpu", "prompts": "chat", "batch": 1, "requests": 4,
         "output_len": 8, "rounds": 1, "speculative_config": "{}", "speedup": 1.5, "tokens_identical": True,
         "configs": {"lookahead": "{la}", "ngram": "{ng}"}, "sides": ["lookahead", "ngram"], "off": side,
         "lookahead": side | {"tok_s": 15.0, "speedup": 1.5, "drafted": 9, "acceptance_rate": 0.25,
                              "mean_accepted_length": 1.75},
         "ngram": side | {"tok_s": 8.0, "speedup": 0.8, "drafted": 4, "acceptance_rate": 0.5,
                          "mean_accepted_length": 2.0}}
    text = render(r)
    assert "lookahead:     15.0 tok/s (1.00 s) 1.50x, acceptance 25.0%, mean accepted length 1.75" in text
    assert "ngram:      8.0 tok/s (1.00 s) 0.80x, acceptance 50.0%" in text and "  ngram: {ng}" in text
