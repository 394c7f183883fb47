"""`atoll serve` on the real engine, through the real openai client: completions and chat,
streaming and not, greedy tokens equal to transformers' at TP2 and PP2 (dense) and DP2EP2
(Qwen3-MoE); bad bodies and an oversized prompt on the real server. One server per layout."""

import asyncio
from types import SimpleNamespace

import httpx
import openai
import pytest
from reference import reference_tokens
from serving import Server, text_of, with_tokenizer

NAME = "tiny"
NEW = 8
PROMPTS = [[5, 7, 9, 11, 13], [100, 3], [42, 1, 2, 3, 4, 5, 6, 7, 8], [250]]
CHATS = [[{"role": "user", "content": "w10 w11 w12"}],
         [{"role": "system", "content": "w40 w41"}, {"role": "user", "content": "w50 w60 w70"}]]
SERVERS = {
    "llama-TP2": ("llama", dict(num_hidden_layers=4), ["-tp", "2"]),
    "llama-PP2": ("llama", dict(num_hidden_layers=4), ["-pp", "2"]),
    "qwen3_moe-DP2EP2": ("qwen3_moe", {}, ["--layout", "DP2EP2"]),
}
GREEDY = dict(temperature=0, max_tokens=NEW, extra_body={"ignore_eos": True, "return_token_ids": True})


def chat_ids(messages) -> list[int]:
    """The chat template's prompt, as the server tokenizes it (tests/serving.py's template)."""
    from serving import words

    text = "".join(f"<|{m['role']}|> {m['content']} <|end|> " for m in messages) + "<|assistant|>"
    vocab = {w: i for i, w in enumerate(words())}
    return [vocab[w] for w in text.split()]


@pytest.fixture(scope="module", params=["llama-TP2", pytest.param("llama-PP2", marks=pytest.mark.slow), "qwen3_moe-DP2EP2"])
def served(request, tiny_model, tmp_path_factory):
    """One layout's server: .server, .name, .completions and .chats (transformers' tokens)."""
    kind, overrides, layout = SERVERS[request.param]
    d = with_tokenizer(tiny_model(kind, **overrides), tmp_path_factory.mktemp("serve") / request.param)
    expected = reference_tokens(d, PROMPTS + [chat_ids(m) for m in CHATS], NEW)
    server = Server(d, *layout, "--served-model-name", NAME, log=d.parent / "server.log")
    try:
        yield SimpleNamespace(server=server, name=request.param, completions=expected[: len(PROMPTS)],
                              chats=expected[len(PROMPTS):])
    finally:
        server.kill()


def client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{server.url}/v1", api_key="none", max_retries=0, timeout=120)


async def _complete(c, prompt, stream: bool):
    if not stream:
        r = await c.completions.create(model=NAME, prompt=prompt, **GREEDY)
        return r.choices[0].token_ids, r.choices[0].text, r.choices[0].finish_reason
    ids, text, reason = [], "", None
    async for chunk in await c.completions.create(model=NAME, prompt=prompt, stream=True, **GREEDY):
        ids += chunk.choices[0].token_ids
        text += chunk.choices[0].text
        reason = chunk.choices[0].finish_reason or reason
    return ids, text, reason


async def _chat(c, messages, stream: bool):
    if not stream:
        r = await c.chat.completions.create(model=NAME, messages=messages, **GREEDY)
        return r.choices[0].token_ids, r.choices[0].message.content, r.usage.prompt_tokens
    ids, text = [], ""
    async for chunk in await c.chat.completions.create(model=NAME, messages=messages, stream=True,
                                                       stream_options={"include_usage": True}, **GREEDY):
        if chunk.choices:
            ids += chunk.choices[0].token_ids
            text += chunk.choices[0].delta.content or ""
        else:
            usage = chunk.usage
    return ids, text, usage.prompt_tokens


@pytest.mark.timeout(600)
def test_completions_match_transformers(served):
    server, expected = served.server, served.completions

    async def go():
        c = client(server)
        return await asyncio.gather(*[_complete(c, p, stream) for stream in (False, True) for p in PROMPTS])

    got = asyncio.run(go())
    for (ids, text, reason), want in zip(got, expected + expected):
        assert ids == want and text == text_of(want) and reason == "length"


@pytest.mark.timeout(300)
def test_chat_matches_transformers(served):
    server, expected = served.server, served.chats

    async def go():
        c = client(server)
        return await asyncio.gather(*[_chat(c, m, stream) for stream in (False, True) for m in CHATS])

    got = asyncio.run(go())
    for (ids, text, prompt_tokens), want, messages in zip(got, expected + expected, CHATS + CHATS):
        assert ids == want and text == text_of(want) and prompt_tokens == len(chat_ids(messages))


@pytest.mark.timeout(300)
def test_bad_requests_get_a_400_naming_the_field(served):
    server = served.server
    if served.name != "llama-TP2":
        pytest.skip("checked on one layout")
    post = lambda body, **kw: httpx.post(f"{server.url}/v1/completions", timeout=30, **kw)  # noqa: E731
    cases = [
        (post(None, content=b'{"prompt": [1, 2', headers={"content-type": "application/json"}), None, "not valid JSON"),
        (post(None, json={"model": "gpt-4", "prompt": [1]}), "model", "not served here"),
        (post(None, json={"prompt": [1], "top_k": -2}), "top_k", "top_k=-2"),
        (post(None, json={"prompt": [7] * 300}), "prompt", "prompt has 300 tokens; the context is 256"),
    ]
    for r, param, text in cases:
        err = r.json()["error"]
        assert r.status_code == 400 and err["param"] == param and text in err["message"], err
    ok = httpx.post(f"{server.url}/v1/completions", json={"prompt": [5, 7], "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200  # the server goes on serving


@pytest.mark.timeout(300)
def test_logprobs_from_the_engine(served):
    """The greedy token is its own likeliest alternative, with the same log-probability."""
    server, expected = served.server, served.completions
    if served.name != "llama-TP2":
        pytest.skip("checked on one layout")

    async def go():
        c = client(server)
        comp = await c.completions.create(model=NAME, prompt=PROMPTS[0], logprobs=2, **GREEDY)
        chat = await c.chat.completions.create(model=NAME, messages=CHATS[0], logprobs=True, top_logprobs=3,
                                               **GREEDY)
        return comp.choices[0].logprobs, chat.choices[0].logprobs

    comp, chat = asyncio.run(go())
    assert comp.tokens == text_of(expected[0]).split() and len(comp.top_logprobs) == NEW
    for token, lp, top in zip(comp.tokens, comp.token_logprobs, comp.top_logprobs):
        assert lp < 0 and len(top) == 2 and max(top, key=top.get) == token and top[token] == pytest.approx(lp)
    assert [e.token for e in chat.content] == text_of(served.chats[0]).split()
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in chat.content)


@pytest.mark.timeout(300)
def test_the_same_seed_gives_the_same_tokens(served):
    if served.name != "llama-TP2":
        pytest.skip("checked on one layout")
    sampled = dict(max_tokens=12, temperature=1.0, top_p=0.95, extra_body={"ignore_eos": True,
                                                                          "return_token_ids": True})

    async def go():
        c = client(served.server)
        runs = [c.completions.create(model=NAME, prompt=PROMPTS[0], seed=seed, **sampled) for seed in (7, 7, 8)]
        return [r.choices[0].token_ids for r in await asyncio.gather(*runs)]

    a, b, other = asyncio.run(go())
    assert a == b and a != other
