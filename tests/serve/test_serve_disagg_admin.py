"""The admin API of a disaggregated server (`atoll serve --prefill TP1 --decode TP1
--decode-replicas 2 --enable-admin-api`, 1P2D, local launcher, a tiny Llama) through httpx:
its three engines listed with role, layout and state; decode engine 1 (engine 2) drained, after
which every new request is decoded on decode engine 0 with transformers' tokens and text; the
one-line refusals (draining the last decode engine, a role change of a serving engine); the
drained engine serving again and taking requests; then drained and switched to prefill (2P1D;
with engine 0 drained every long prompt is prefilled on it), and back to decode, texts unchanged throughout."""

from concurrent.futures import ThreadPoolExecutor

import time

import httpx
import pytest
from reference import reference_tokens
from serving import Server, text_of, with_tokenizer

NAME = "tiny"
NEW = 6
MIN = 10  # --disagg-min-prompt-tokens: LONG prompts are prefilled on the prefill engine
LONG = 6  # prompts of MIN tokens or more in each round, then two short ones


def prompts(round_: int) -> list[list[int]]:
    """A round's prompts, new to every engine's prefix cache (a cached prompt stays on its decode engine)."""
    return [[(7 * i + 13 * round_ + k) % 290 + 7 for i in range(12 + k)] for k in range(LONG)] + \
        [[5 + round_, 7, 9], [42, round_, 2, 3]]


ROUNDS = 5


def _complete(url: str, prompt: list[int]) -> tuple[list[int], str]:
    r = httpx.post(f"{url}/v1/completions", timeout=180,
                   json={"model": NAME, "prompt": prompt, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
                         "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"], r.json()["choices"][0]["text"]


def _all(url: str, prompts) -> list[tuple[list[int], str]]:
    """Every prompt at once (so that both decode engines would be used if both served)."""
    with ThreadPoolExecutor(len(prompts)) as pool:
        return list(pool.map(lambda p: _complete(url, p), prompts))


def _engines(h) -> list[dict]:
    r = h.get("/admin/engines")
    assert r.status_code == 200, r.text
    return r.json()["data"]


def _taken(h) -> list[int]:
    return [e["taken"] for e in _engines(h)]


def _drain_idle(h, k: int, timeout_s: float = 60) -> None:
    """Drain engine k and wait until nothing runs there."""
    assert h.post(f"/admin/engines/{k}/drain").status_code == 200
    deadline = time.monotonic() + timeout_s
    while _engines(h)[k]["state"] != "drained":
        assert time.monotonic() < deadline, _engines(h)[k]
        time.sleep(0.1)


def _refused(r, status: int, line: str) -> None:
    msg = r.json()["error"]["message"]
    assert r.status_code == status and line in msg and "\n" not in msg, (r.status_code, r.text)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_a_decode_engine_is_drained_and_serves_again(tiny_model, tmp_path):
    d = with_tokenizer(tiny_model("llama", num_hidden_layers=2), tmp_path / "m")
    rounds = [prompts(r) for r in range(ROUNDS)]
    wants = [reference_tokens(d, p, NEW) for p in rounds]
    server = Server(d, "--prefill", "TP1", "--decode", "TP1", "--decode-replicas", "2", "--served-model-name", NAME,
                    "--disagg-min-prompt-tokens", MIN, "--enable-admin-api", log=tmp_path / "server.log")
    try:
        with httpx.Client(base_url=server.url, timeout=120) as h:
            engines = _engines(h)
            assert [(e["id"], e["role"], e["layout"], e["state"], e["health"]) for e in engines] == \
                [(0, "prefill", "TP1", "serving", "ok"), (1, "decode", "TP1", "serving", "ok"),
                 (2, "decode", "TP1", "serving", "ok")]

            before = _taken(h)  # both decode engines serve: at once, the prompts go to both
            assert [g[0] for g in _all(server.url, rounds[0])] == wants[0]
            after = _taken(h)
            assert after[1] > before[1] and after[2] > before[2], (before, after)

            r = h.post("/admin/engines/2/drain")
            assert r.status_code == 200 and r.json()["state"] == "drained", r.text
            got = _all(server.url, rounds[1])
            assert [g[0] for g in got] == wants[1]
            assert [g[1] for g in got] == [text_of(w) for w in wants[1]]
            drained = _taken(h)
            assert drained[2] == after[2], (after, drained)  # nothing new on decode engine 1
            assert drained[1] == after[1] + len(rounds[0])  # every request decoded on decode engine 0
            assert drained[0] > after[0]  # the long prompts still prefilled on the prefill engine

            _refused(h.post("/admin/engines/1/drain"), 409, "engine 1 is the last decode engine serving")
            _refused(h.post("/admin/engines/1/role", json={"role": "prefill"}), 409,
                     "engine 1 is serving: drain it")
            _refused(h.post("/admin/engines/9/drain"), 404, "engine 9 does not exist")

            r = h.post("/admin/engines", json={"id": 2})
            assert r.status_code == 200 and r.json()["state"] == "serving", r.text
            again = _all(server.url, rounds[2])
            assert [g[0] for g in again] == wants[2]
            served = _taken(h)
            assert served[2] > drained[2]

            # 2P1D: engine 2 drained, switched to prefill, serving again
            _drain_idle(h, 2)
            r = h.post("/admin/engines/2/role", json={"role": "prefill"})
            assert r.status_code == 200 and (r.json()["role"], r.json()["state"]) == ("prefill", "drained"), r.text
            assert h.post("/admin/engines", json={"id": 2}).json()["state"] == "serving"
            assert [(e["role"], e["state"]) for e in _engines(h)] == \
                [("prefill", "serving"), ("decode", "serving"), ("prefill", "serving")]
            _drain_idle(h, 0)  # the first prefill engine drained: engine 2 prefills every long prompt
            got = _all(server.url, rounds[3])
            assert [g[0] for g in got] == wants[3] and [g[1] for g in got] == [text_of(w) for w in wants[3]]
            prefilled = _taken(h)
            assert prefilled[2] == served[2] + LONG and prefilled[0] == served[0], (served, prefilled)
            assert prefilled[1] == served[1] + len(rounds[0])  # every request decoded on engine 1
            assert h.post("/admin/engines", json={"id": 0}).json()["state"] == "serving"

            # and back to decode (1P2D)
            _drain_idle(h, 2)
            assert h.post("/admin/engines/2/role", json={"role": "decode"}).json()["role"] == "decode"
            h.post("/admin/engines", json={})
            got = _all(server.url, rounds[4])
            assert [g[0] for g in got] == wants[4]
            back = _taken(h)
            assert back[2] > prefilled[2] and back[1] < prefilled[1] + len(rounds[0]), (prefilled, back)
    finally:
        server.kill()
