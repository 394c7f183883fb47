"""`atoll calibrate --steps` measures a model's ticks as it serves (bench/serve_steps.py): a real
`atoll serve` with --step-trace, the fixed lists streamed by the bench's client, the second
pass fitted."""

import pytest

from atoll.bench.serve_steps import measure_steps, request_lists


def test_the_lists_cover_decode_batches_long_prompts_and_joining():
    lists = request_lists(301, quick=True)
    sizes = [len(rs) for rs, rate in lists if rate == float("inf")]
    assert sizes[:3] == [1, 4, 16]  # decode batches
    assert any(len(r.prompt) >= 512 for rs, _ in lists for r in rs)  # a long prompt
    assert lists[-1][1] < float("inf")  # prompts joining at a rate


@pytest.mark.timeout(600)
def test_served_steps_fit_the_ticks_of_a_real_server(tiny_model):
    fits = measure_steps(tiny_model("llama"), ["TP1"], quick=True)
    f = fits["TP1"]
    # the second pass only: its decode rows and prompt tokens, one engine's ticks
    assert f["samples"] >= 20 and set(f["rows_us"]) >= {1, 4, 16}
    assert all(v >= 0 for v in f["rows_us"].values()) and f["chunk_token_us"] >= 0
    assert 0 < f["rel_rms"] < 1 and max(f["rows_us"].values()) > 0
