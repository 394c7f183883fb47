"""The planner's step predictions and their live correction on a real server (`atoll serve -dp 2
--enable-admin-api`, local launcher, a tiny Llama): after greedy requests, /admin/engines shows
each replica's predicted step (the simulator's StepCost for the ticks it ran), its measured step
and the correction factor, in one line each."""

import statistics
import types

import httpx
import pytest
from reference import reference_tokens
from serving import Server, with_tokenizer

from atoll.cli.main import build_parser
from atoll.parallel.layout import Layout
from atoll.serve.predict import for_server

NAME = "tiny"
PROMPT = [5, 7, 9, 11]
NEW = 6


def _predicted_ms(cost) -> float:
    """The median predicted tick of one request of PROMPT and NEW greedy tokens run alone: its
    prompt in one chunk, then a decode row a token at contexts len(PROMPT) + 1, ..."""
    n = len(PROMPT)
    ticks = [cost.tick(0, n, 0, n * n / 2)[1]] + [cost.tick(1, 0, n + k, 0)[1] for k in range(1, NEW)]
    return 1000 * statistics.median(ticks)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_admin_engines_show_each_replicas_predicted_step_and_its_correction(tiny_model, tmp_path):
    d = with_tokenizer(tiny_model("llama", max_position_embeddings=512), tmp_path / "m")
    expected = reference_tokens(d, [PROMPT], NEW)[0]
    flags = ["-dp", "2", "--router", "round_robin", "--served-model-name", NAME, "--enable-admin-api"]
    server = Server(d, *flags, log=tmp_path / "server.log")
    try:
        with httpx.Client(base_url=server.url, timeout=120) as h:
            before = {e["id"]: e["step"] for e in h.get("/admin/engines").json()["data"]}
            assert before[0]["ticks"] == 0 and before[0]["line"] == "replica 0: no step measured yet (correction 1.00)"
            for _ in range(4):  # one at a time, two to each replica
                r = h.post("/v1/completions", json={"model": NAME, "prompt": PROMPT, "max_tokens": NEW,
                                                    "temperature": 0, "ignore_eos": True, "return_token_ids": True})
                assert r.status_code == 200 and r.json()["choices"][0]["token_ids"] == expected, r.text
            steps = {e["id"]: e["step"] for e in h.get("/admin/engines").json()["data"]}
    finally:
        server.kill()
    # the cost the server predicts by, built from the same flags
    args = build_parser().parse_args(["serve", "--model", str(d), *flags])
    llm = types.SimpleNamespace(model_dir=d, layout=Layout.parse("TP1"), prefill_layout=None)
    cost = for_server(args, llm, [], replicas=2, log=print).costs["decode"]
    for k in (0, 1):
        s = steps[k]
        assert s["ticks"] == 2 * NEW, s  # a prefill tick and NEW - 1 decode ticks a request
        assert s["predicted_step_ms"] == pytest.approx(_predicted_ms(cost), rel=1e-3), s
        assert s["measured_step_ms"] > 0 and s["correction"] > 0
        # the factor is a median of ratios, the figures medians of each: alike over these ticks
        assert s["predicted_step_ms"] * s["correction"] == pytest.approx(s["measured_step_ms"], rel=0.3), s
        assert s["line"].startswith(f"replica {k}: predicted step {s['predicted_step_ms']:.2f} ms x correction "
                                    f"{s['correction']:.2f}"), s
