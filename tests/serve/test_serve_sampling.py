"""`atoll serve` at TP2 with the sampling parameters agents send, through the real openai
client, curl and httpx: echo and prompt logprobs equal to transformers', n = 4 computing its
prompt once (the server's /metrics) with seeded copies reproducible and streamed by index,
penalties and logit_bias equal to transformers' with the same processors, vLLM's /tokenize
and /detokenize, and bad values refused by name while the server serves on."""

import asyncio
import json
import subprocess
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch
from reference import reference_processed
from serving import Server, text_of, with_tokenizer, words

NAME = "tiny"
PROMPT = [5, 7, 9, 11, 13, 5, 7, 9, 21, 22, 23, 24, 25, 26, 27, 28, 29, 30, 31, 32]  # 20 tokens: a block and a part


@pytest.fixture(scope="module")
def served(tiny_model, tmp_path_factory):
    d = with_tokenizer(tiny_model("llama", num_hidden_layers=2), tmp_path_factory.mktemp("serve-sampling") / "m")
    server = Server(d, "-tp", "2", "--served-model-name", NAME, log=d.parent / "server.log")
    try:
        yield SimpleNamespace(server=server, model_dir=d)
    finally:
        server.kill()


def client(server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


def reference_prompt_logprobs(model_dir, prompt):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return torch.log_softmax(ref(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)


@pytest.mark.timeout(120)
def test_echo_and_prompt_logprobs(served):
    c, text = client(served.server), text_of(PROMPT)
    want = reference_prompt_logprobs(served.model_dir, PROMPT)
    r = c.completions.create(model=NAME, prompt=text, max_tokens=3, temperature=0, echo=True, logprobs=2,
                             extra_body={"prompt_logprobs": 1, "ignore_eos": True})
    choice = r.choices[0]
    out = choice.text[len(text):]
    assert choice.text.startswith(text) and len(out.split()) == 3
    lp = choice.logprobs
    assert lp.tokens[:len(PROMPT)] == text.split() and lp.tokens[len(PROMPT):] == out.split()
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    for q in range(1, len(PROMPT)):
        assert lp.token_logprobs[q] == pytest.approx(float(want[q - 1, PROMPT[q]]), abs=1e-4)
        assert len(lp.top_logprobs[q]) == 2
    entries = choice.model_extra["prompt_logprobs"]
    assert entries[0] is None and len(entries) == len(PROMPT)
    for q, entry in enumerate(entries[1:]):
        own = entry[str(PROMPT[q + 1])]
        assert own["logprob"] == pytest.approx(float(want[q, PROMPT[q + 1]]), abs=1e-4)
        assert own["rank"] == 1 + int((want[q] > want[q, PROMPT[q + 1]]).sum())
        assert own["decoded_token"] == words()[PROMPT[q + 1]]
        best = int(want[q].argmax())
        assert entry[str(best)]["rank"] == 1
    # streamed: the first chunk carries the echo and the prompt's logprobs, the chunks add up
    chunks = list(c.completions.create(model=NAME, prompt=text, max_tokens=3, temperature=0, echo=True, logprobs=2,
                                       stream=True, extra_body={"prompt_logprobs": 1, "ignore_eos": True}))
    assert "".join(ch.choices[0].text for ch in chunks) == choice.text
    assert chunks[0].choices[0].model_extra["prompt_logprobs"] == entries
    streamed = [x for ch in chunks for x in ch.choices[0].logprobs.token_logprobs]
    assert streamed[0] is None and streamed[1:] == pytest.approx(lp.token_logprobs[1:])
    # chat: the prompt's logprobs on the response, as vLLM gives them
    chat = c.chat.completions.create(model=NAME, messages=[{"role": "user", "content": text}], max_tokens=2,
                                     extra_body={"prompt_logprobs": 0})
    assert chat.model_extra["prompt_logprobs"][0] is None
    assert len(chat.model_extra["prompt_logprobs"]) == chat.usage.prompt_tokens


@pytest.mark.timeout(120)
def test_n4_computes_the_prompt_once_and_seeded_copies_reproduce(served):
    server, c = served.server, client(served.server)
    prompt_ids = [250 - i for i in range(20)]  # no other test's: the first request finds nothing cached
    before = server.metrics()
    body = dict(model=NAME, prompt=prompt_ids, max_tokens=6, n=4, seed=3, extra_body={"ignore_eos": True})
    a, b = (c.completions.create(**body) for _ in range(2))
    after = server.metrics()
    texts = [ch.text for ch in sorted(a.choices, key=lambda ch: ch.index)]
    assert [ch.index for ch in a.choices] == [0, 1, 2, 3]
    assert texts == [ch.text for ch in sorted(b.choices, key=lambda ch: ch.index)]
    assert len(set(texts)) == 4  # temperature 1: the copies differ
    prompt = after["atoll_prompt_tokens_total"] - before["atoll_prompt_tokens_total"]
    cached = after["atoll_prompt_tokens_cached_total"] - before["atoll_prompt_tokens_cached_total"]
    assert prompt == 2 * 4 * 20
    # the first request computed its prompt once; the second found its full block cached
    assert prompt - cached == 20 + (20 - 16)
    assert a.usage.prompt_tokens == 20 and a.usage.completion_tokens == 24
    # streamed chat: each choice by its index, adding up to the same copies as unstreamed
    messages = [{"role": "user", "content": "w10 w11 w12"}]
    whole = c.chat.completions.create(model=NAME, messages=messages, max_tokens=5, n=4, seed=9)
    parts = {i: "" for i in range(4)}
    for chunk in c.chat.completions.create(model=NAME, messages=messages, max_tokens=5, n=4, seed=9, stream=True):
        for ch in chunk.choices:
            parts[ch.index] += ch.delta.content or ""
    assert [parts[i] for i in range(4)] == [ch.message.content for ch in sorted(whole.choices, key=lambda x: x.index)]


@pytest.mark.timeout(120)
def test_penalties_and_logit_bias_match_transformers(served):
    kw = dict(presence=0.5, frequency=0.3, repetition=1.2, bias={17: 3.0, 204: -100.0}, min_tokens=3,
              bad_words=((words().index("w30"),),))
    want = reference_processed(served.model_dir, [PROMPT], 8, **kw)[0]
    r = client(served.server).completions.create(
        model=NAME, prompt=PROMPT, max_tokens=8, temperature=0, presence_penalty=0.5, frequency_penalty=0.3,
        logit_bias={"17": 3.0, "204": -100}, extra_body={"repetition_penalty": 1.2, "min_tokens": 3,
                                                         "bad_words": ["w30"], "ignore_eos": True,
                                                         "return_token_ids": True})
    assert r.choices[0].token_ids == want


@pytest.mark.timeout(120)
def test_tokenize_and_detokenize(served):
    url = served.server.url
    out = subprocess.run(["curl", "-s", "-X", "POST", f"{url}/tokenize", "-H", "Content-Type: application/json",
                          "-d", json.dumps({"model": NAME, "prompt": "w10 w11 w250", "return_token_strs": True})],
                         capture_output=True, text=True, timeout=60, check=True)
    assert json.loads(out.stdout) == {"count": 3, "max_model_len": 256, "tokens": [10, 11, 250],
                                      "token_strs": ["w10", "w11", "w250"]}
    chat = httpx.post(f"{url}/tokenize", json={"messages": [{"role": "user", "content": "w10"}]}, timeout=30).json()
    assert chat["tokens"] == [4, 10, 6, 5]  # <|user|> w10 <|end|> <|assistant|>
    back = httpx.post(f"{url}/detokenize", json={"model": NAME, "tokens": [10, 11, 250]}, timeout=30)
    assert back.json() == {"prompt": "w10 w11 w250"}
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [10, 301]}, timeout=30)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


@pytest.mark.timeout(120)
def test_bad_values_are_400_naming_the_field_and_the_server_serves_on(served):
    url = served.server.url
    cases = [({"n": 0}, "n"), ({"logit_bias": {"abc": 1}}, "logit_bias"), ({"logit_bias": {"5": 150}}, "logit_bias"),
             ({"logit_bias": {"400": 1}}, "logit_bias"), ({"presence_penalty": -3}, "presence_penalty"),
             ({"repetition_penalty": -1}, "repetition_penalty"), ({"n": 2, "temperature": 0}, "n")]

    async def go():
        async with httpx.AsyncClient(timeout=60) as http:
            return await asyncio.gather(*[http.post(f"{url}/v1/completions", json={"prompt": [5, 7], **body})
                                          for body, _ in cases])

    for r, (body, param) in zip(asyncio.run(go()), cases):
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and "\n" not in err["message"], (body, err)
    ok = httpx.post(f"{url}/v1/completions", json={"prompt": [5, 7], "max_tokens": 2, "n": 2}, timeout=60)
    assert ok.status_code == 200 and len(ok.json()["choices"]) == 2


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_copies_follow_their_first_copy_to_its_replica(tiny_model, tmp_path_factory):
    """Under -dp 2 (two replicas behind the router) each request's copies go where its first
    copy went and fork there: each prompt is computed once."""
    d = with_tokenizer(tiny_model("llama", num_hidden_layers=2), tmp_path_factory.mktemp("serve-copies") / "m")
    server = Server(d, "-dp", "2", "--served-model-name", NAME, log=d.parent / "server.log")
    try:
        c = client(server)

        async def go():
            ac = openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)
            return await asyncio.gather(*[ac.completions.create(model=NAME, prompt=[200 + p] * 20, max_tokens=4,
                                                                n=4, seed=p) for p in range(3)])

        before = server.metrics()
        outs = asyncio.run(go())
        after = server.metrics()
        assert all(len(r.choices) == 4 for r in outs) and c.models.list().data[0].id == NAME
        delta = {k: after[k] - before.get(k, 0) for k in after if k.startswith("atoll_")}
        assert delta["atoll_prompt_tokens_total"] == 3 * 4 * 20
        assert delta["atoll_prompt_tokens_total"] - delta["atoll_prompt_tokens_cached_total"] == 3 * 20
        copies = sum(v for k, v in delta.items() if k.startswith("atoll_router_requests_total") and 'reason="copy"' in k)
        assert copies == 3 * 3
    finally:
        server.kill()
