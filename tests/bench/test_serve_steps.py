"""`atoll calibrate --steps` measures a model's ticks as it serves (bench/serve_steps.py): a real
`atoll serve` with --step-trace, the fixed lists streamed by the bench's client, the second
pass fitted."""

import numpy as np
import pytest

from atoll.bench.serve_steps import request_lists, served_ticks
from atoll.parallel.layout import Layout
from atoll.planner.sim.stepfit import fit


def test_the_lists_cover_decode_batches_long_prompts_and_joining():
    lists = request_lists(301, quick=True)
    sizes = [len(rs) for rs, rate in lists if rate == float("inf")]
    assert sizes[:3] == [1, 4, 16]  # decode batches
    assert any(len(r.prompt) >= 512 for rs, _ in lists for r in rs)  # a long prompt
    assert lists[-1][1] < float("inf")  # prompts joining at a rate



def test_replicas_served_together_each_get_a_lists_rows():
    one, two = request_lists(301), request_lists(301, copies=2)
    assert [(2 * len(rs), 2 * rate) for rs, rate in one] == [(len(rs), rate) for rs, rate in two]
    assert [[len(r.prompt) for r in rs[::2]] for rs, _ in two] == [[len(r.prompt) for r in rs] for rs, _ in one]
    prompts = [tuple(r.prompt) for rs, _ in two for r in rs]
    assert len(set(prompts)) == len(prompts)  # no prefix-cache hit between the copies


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_served_steps_fit_the_ticks_of_a_real_server(tiny_model):
    ticks = served_ticks(tiny_model("llama"), Layout.parse("TP1"), 1, quick=True)
    f = fit(ticks)
    d = f.to_dict()
    # the second pass only: its decode rows and prompt tokens, one engine's ticks
    assert d["samples"] == len(ticks) >= 20 and set(d["rows_us"]) >= {1, 4, 16}
    assert all(v >= 0 for v in d["rows_us"].values()) and d["chunk_token_us"] >= 0
    assert max(d["rows_us"].values()) > 0 and d["rel_rms"] > 0 and d["rel_median"] > 0
    # the fit follows the typical tick of each kind at its own shape. A tick here is a few
    # milliseconds, and on a shared 2-core machine a few take 30-100x that (a core taken away
    # mid-step), so the check is on medians; the RMS squares those ticks and is not bounded
    ratio = np.array([f.seconds(*t[:4]) / t[4] for t in ticks])
    decode = np.array([t[1] == 0 for t in ticks])
    assert 2 / 3 < np.median(ratio[decode]) < 1.5, np.median(ratio[decode])
    assert 1 / 3 < np.median(ratio[~decode]) < 3, np.median(ratio[~decode])  # fewer, and noisier
