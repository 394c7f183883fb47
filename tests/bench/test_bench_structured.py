"""atoll bench structured: a JSON schema's cost side by side with the same requests free (a smoke
run on the real model: both sides generate the same tokens count, the schema side fills a mask
every step)."""

import json

import cli
import pytest


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_bench_structured_smoke(capsys, smollm2_dir):
    code, out, err = cli.run_cli(capsys, "bench", "structured", "--model", str(smollm2_dir), "--batch", "1", "2",
                                 "--output-len", "12", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["compile"]["cold_s"] > r["compile"]["cached_s"] > 0
    for b in ("1", "2"):
        free, schema = r["batches"][b]["free"], r["batches"][b]["schema"]
        assert free["masks"] == 0 and schema["masks"] == 12  # one fill a decode step, the first token's included
        assert 0 <= schema["waited_s"] <= schema["total_s"]
        assert r["batches"][b]["ratio"] == pytest.approx(schema["tok_s"] / free["tok_s"], rel=1e-6)
