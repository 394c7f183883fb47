"""`atoll serve --speculative-config`: greedy completions equal to transformers' with n-gram
speculation at TP2, and the drafted / accepted counts in /metrics."""

import json

import httpx
import pytest
from reference import reference_tokens
from serving import Server, with_tokenizer

PROMPTS = [[5, 7, 9, 11, 13] * 3, [42, 1, 2, 3, 4, 5, 6, 7, 8] * 2]
NEW = 24


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_serve_with_ngram_speculation(tiny_model, tmp_path):
    d = with_tokenizer(tiny_model("llama", num_hidden_layers=4), tmp_path / "model")
    expected = reference_tokens(d, PROMPTS, NEW)
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
    server = Server(d, "-tp", "2", "--speculative-config", spec, "--served-model-name", "tiny",
                    log=tmp_path / "server.log")
    try:
        got = []
        for p in PROMPTS:
            r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
                "model": "tiny", "prompt": p, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            got.append(r.json()["choices"][0]["token_ids"])
        assert got == expected
        m = server.metrics()
        drafted, accepted = m["atoll_spec_decode_num_draft_tokens_total"], m["atoll_spec_decode_num_accepted_tokens_total"]
        assert 0 < accepted < drafted
        assert m["atoll_spec_decode_acceptance_rate"] == pytest.approx(accepted / drafted)
        assert m["atoll_spec_decode_mean_accepted_length"] > 1
    finally:
        server.kill()
