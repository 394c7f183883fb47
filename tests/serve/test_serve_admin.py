"""The admin API and --autoscale on a real server (`atoll serve -dp 2`, local launcher, a tiny
model), through httpx: engines listed with their ranks' pids, drained (the other one takes the
requests, with transformers' tokens), removed (its ranks end), added back (new ranks), the
one-line 4xx refusals, the API key; and the autoscaler draining an idle replica and adding it
back under load, each decision with its reason and counted in /metrics."""

import json
import os
import threading
import time

import httpx
import pytest
from reference import reference_tokens
from serving import Server, with_tokenizer

NAME, KEY = "tiny", "sekret"
NEW = 6
LONG = 300
AUTH = {"Authorization": f"Bearer {KEY}"}
PROMPT = [5, 7, 9, 11]


def _complete(url: str) -> list[int]:
    r = httpx.post(f"{url}/v1/completions", headers=AUTH, timeout=120,
                   json={"model": NAME, "prompt": PROMPT, "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
                         "return_token_ids": True})
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def _stream(url: str, got: list) -> None:
    """A streamed greedy completion of LONG tokens; its token ids into got (an error event raises)."""
    body = {"model": NAME, "prompt": PROMPT, "max_tokens": LONG, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True, "stream": True}
    with httpx.stream("POST", f"{url}/v1/completions", headers=AUTH, json=body, timeout=120) as r:
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                assert "error" not in chunk, chunk
                got += chunk["choices"][0]["token_ids"]


def _decided(metrics: dict, action: str, role: str) -> float:
    """atoll_autoscale_decisions_total of this action and role, applied."""
    want = (f'action="{action}"', f'role="{role}"', 'applied="true"')
    return sum(v for k, v in metrics.items() if k.startswith("atoll_autoscale_decisions_total{")
               and all(w in k for w in want))


def _routed(server, replica: int) -> float:
    return sum(v for k, v in server.metrics().items()
               if k.startswith("atoll_router_requests_total{") and f'replica="{replica}"' in k)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_engines_are_listed_drained_removed_and_added_back(tiny_model, tmp_path):
    d = with_tokenizer(tiny_model("llama", max_position_embeddings=512), tmp_path / "m")
    long = reference_tokens(d, [PROMPT], LONG)[0]
    expected = long[:NEW]
    server = Server(d, "-dp", "2", "--router", "round_robin", "--served-model-name", NAME, "--api-key", KEY,
                    "--enable-admin-api", log=tmp_path / "server.log")
    url = server.url
    try:
        with httpx.Client(base_url=url, timeout=120) as h:
            assert h.get("/admin/engines").status_code == 401  # behind the key
            engines = h.get("/admin/engines", headers=AUTH).json()["data"]
            assert [(e["id"], e["role"], e["state"], e["health"], e["layout"]) for e in engines] == \
                [(0, "replica", "serving", "ok", "TP1"), (1, "replica", "serving", "ok", "TP1")]
            pids = [e["pids"] for e in engines]
            assert all(len(p) == 1 and _alive(p[0]) for p in pids), pids

            r = h.post("/admin/engines/5/drain", headers=AUTH)
            assert r.status_code == 404 and "engine 5 does not exist" in r.json()["error"]["message"], r.text
            r = h.post("/admin/engines/0/role", headers=AUTH, json={"role": "leader"})
            assert r.status_code == 400 and r.json()["error"]["param"] == "role", r.text
            r = h.post("/admin/engines/0/role", headers=AUTH, json={"role": "prefill"})
            assert r.status_code == 409 and "is a replica" in r.json()["error"]["message"], r.text
            r = h.post("/admin/engines", headers=AUTH, json={})
            assert r.status_code == 409 and "no free engine slot" in r.json()["error"]["message"], r.text

            assert h.post("/admin/engines/0/drain", headers=AUTH).json()["state"] == "drained"
            r = h.post("/admin/engines/1/drain", headers=AUTH)
            assert r.status_code == 409 and "last one serving" in r.json()["error"]["message"], r.text
            before = _routed(server, 1)
            assert [_complete(url) for _ in range(3)] == [expected] * 3
            assert _routed(server, 1) - before == 3 and _routed(server, 0) == 0  # round robin skips the drained one

            assert h.post("/admin/engines/0/remove", headers=AUTH, json={"timeout_s": 5}).json()["state"] == "removed"
            deadline = time.monotonic() + 30
            while _alive(pids[0][0]) and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not _alive(pids[0][0])  # its rank ended
            assert h.get("/health").json()["status"] == "ok"  # removed on purpose: not a failure

            added = h.post("/admin/engines", headers=AUTH, json={}).json()
            assert (added["id"], added["state"]) == (0, "serving")
            assert added["pids"] and added["pids"] != pids[0] and _alive(added["pids"][0])
            assert h.post("/admin/engines/1/drain", headers=AUTH).json()["state"] == "drained"
            assert _complete(url) == expected
            assert _routed(server, 0) == 1  # the restarted engine served it
            assert h.post("/admin/engines", headers=AUTH, json={"id": 1}).json()["state"] == "serving"

            # a stream running on an engine removed without waiting goes on elsewhere with its tokens
            got: list[int] = []
            streaming = threading.Thread(target=_stream, args=(url, got), daemon=True)
            streaming.start()
            deadline = time.monotonic() + 60
            while len(got) < 5 and time.monotonic() < deadline:
                time.sleep(0.05)
            [busy] = [e["id"] for e in h.get("/admin/engines", headers=AUTH).json()["data"] if e["load"]["unfinished"]]
            assert h.post(f"/admin/engines/{busy}/remove", headers=AUTH, json={"timeout_s": 0}).json()["state"] == \
                "removed"
            streaming.join(timeout=120)
            assert got == long, (len(got), server.text()[-2000:])  # nothing repeated, missing or erred
            assert server.metrics()["atoll_router_migrations_total"] == 1
        assert "engine 0 removed" in server.text() and "engine 0 started again" in server.text()
    finally:
        server.kill()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_autoscale_drains_an_idle_replica_and_adds_it_back_under_load(tiny_model, tmp_path):
    d = with_tokenizer(tiny_model("llama", max_position_embeddings=512), tmp_path / "m")
    # a 1 ms TTFT no CPU meets: idle, nothing is measured and a replica is drained; loaded, it is short
    server = Server(d, "-dp", "2", "--served-model-name", NAME, "--api-key", KEY, "--autoscale",
                    "--goodput", "ttft:1", "tpot:1", "--autoscale-interval-s", "2", log=tmp_path / "server.log")
    try:
        def decisions():
            return httpx.get(f"{server.url}/admin/autoscale", headers=AUTH, timeout=30).json()["data"]

        r = httpx.get(f"{server.url}/admin/engines", headers=AUTH, timeout=30)
        assert r.status_code == 404 and "--enable-admin-api" in r.json()["error"]["message"], r.text
        deadline = time.monotonic() + 60
        while not decisions() and time.monotonic() < deadline:
            time.sleep(0.2)
        first = decisions()[0]
        assert (first["action"], first["role"]) == ("drain", "replica"), first
        assert "nothing waiting" in first["reason"]
        deadline = time.monotonic() + 90
        while not any(x["action"] == "add" for x in decisions()) and time.monotonic() < deadline:
            _complete(server.url)
        add = next(x for x in decisions() if x["action"] == "add")
        assert add["role"] == "replica" and add["engine"] == first["engine"], add
        assert "TTFT attainment 0% < 85%" in add["reason"], add
        m = server.metrics()
        assert _decided(m, "add", "replica") >= 1 and _decided(m, "drain", "replica") >= 1
        assert "autoscale: drain replica" in server.text()
    finally:
        server.kill()


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_autoscale_raises_a_disaggregated_servers_local_prefill_threshold_first(tiny_model, tmp_path):
    d = with_tokenizer(tiny_model("llama", max_position_embeddings=512), tmp_path / "m")
    expected = reference_tokens(d, [PROMPT + [13, 15]], NEW)[0]
    # 6-token prompts go to the prefill engine at a threshold of 4, and stay on decode from 8 on
    server = Server(d, "--prefill", "TP1", "--decode", "TP1", "--disagg-min-prompt-tokens", 4, "--served-model-name",
                    NAME, "--autoscale", "--goodput", "ttft:1", "tpot:60000", "--autoscale-interval-s", "2",
                    log=tmp_path / "server.log")
    try:
        def routed(decision: str) -> float:
            return server.metrics().get(f'atoll_disagg_routed{{decision="{decision}"}}', 0.0)

        def ask() -> list[int]:
            r = httpx.post(f"{server.url}/v1/completions", timeout=120, json={
                "model": NAME, "prompt": PROMPT + [13, 15], "max_tokens": NEW, "temperature": 0, "ignore_eos": True,
                "return_token_ids": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["token_ids"]

        assert ask() == expected and routed("prefill") == 1 and routed("decode") == 0
        deadline = time.monotonic() + 90
        while "autoscale: threshold decode" not in server.text() and time.monotonic() < deadline:
            assert ask() == expected
        assert "local-prefill threshold 4 -> 8" in server.text(), server.text()[-2000:]
        before = routed("decode")
        assert ask() == expected
        assert routed("decode") == before + 1  # the new threshold keeps it on the decode engine
        assert _decided(server.metrics(), "threshold", "decode") >= 1
        # listed at GET /admin/autoscale without --enable-admin-api, whose engine routes stay off
        listed = httpx.get(f"{server.url}/admin/autoscale", timeout=30).json()["data"]
        assert any(d["action"] == "threshold" and d["threshold"] == 8 for d in listed), listed
        assert httpx.get(f"{server.url}/admin/engines", timeout=30).status_code == 404
    finally:
        server.kill()
