"""`atoll generate`'s request lines take the sampling parameters the server takes, by vLLM's
names: penalties, logit_bias, min_tokens, bad words, n, logprobs and prompt_logprobs; a bad
value is that line's error naming the field, and the other lines run."""

import json

import pytest
from cli import run_cli
from reference import reference_processed, reference_tokens

PROMPT = [5, 7, 9, 11, 13, 5, 7, 9]


@pytest.mark.timeout(120)
def test_request_lines_take_the_sampling_parameters(capsys, tiny_model, tmp_path):
    d = tiny_model("llama", num_hidden_layers=2)
    greedy = reference_tokens(d, [PROMPT], 6)[0]
    kw = dict(presence=0.5, frequency=0.3, repetition=1.2, bias={greedy[0]: -3.0}, min_tokens=2,
              stop_ids=(greedy[1],), bad_words=((greedy[2],),))
    processed = reference_processed(d, [PROMPT], 6, **kw)[0]
    assert processed != greedy
    lines = [
        {"id": "pen", "prompt_token_ids": PROMPT, "presence_penalty": 0.5, "frequency_penalty": 0.3,
         "repetition_penalty": 1.2, "logit_bias": {str(greedy[0]): -3.0}, "min_tokens": 2,
         "stop_token_ids": [greedy[1]], "bad_words": [], "ignore_eos": True},
        {"id": "bad-words", "prompt_token_ids": PROMPT, "bad_words": ["w1"], "ignore_eos": True},
        {"id": "n", "prompt_token_ids": PROMPT, "n": 3, "temperature": 1.0, "top_k": 1, "seed": 5,
         "prompt_logprobs": 1, "logprobs": 2, "ignore_eos": True},
        {"id": "range", "prompt_token_ids": PROMPT, "logit_bias": {"5": 300}},
        {"id": "vocab", "prompt_token_ids": PROMPT, "logit_bias": {"999": 1}},
    ]
    prompts, out = tmp_path / "p.jsonl", tmp_path / "out.jsonl"
    prompts.write_text("".join(json.dumps(x) + "\n" for x in lines))
    code, _, err = run_cli(capsys, "generate", "--model", d, "--prompts", prompts, "--output", out,
                           "--max-new-tokens", "6", "--no-progress")
    rows = {r["id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert code == 1, err  # two lines failed, the others ran
    stop = next((i for i, t in enumerate(processed) if t == greedy[1] and i >= 2), None)  # past min_tokens
    want = processed if stop is None else processed[:stop + 1]
    assert rows["pen"]["token_ids"] == want
    assert "no tokenizer.json" in rows["bad-words"]["error"] and rows["bad-words"]["error"].startswith("line 2")
    n = rows["n"]
    assert [o["token_ids"] for o in n["outputs"]] == [greedy] * 3 and n["token_ids"] == greedy
    assert len(n["prompt_logprobs"]) == len(PROMPT) and n["prompt_logprobs"][0] is None
    assert len(n["logprobs"]) == 6 and len(n["logprobs"][0]["top"]) == 2
    assert "the bias of token 5 is 300" in rows["range"]["error"]
    assert "logit_bias: token 999 is outside the vocabulary" in rows["vocab"]["error"]
