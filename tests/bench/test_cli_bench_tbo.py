"""atoll bench tbo: a small run on a tiny DeepSeek-V3 prints both sides per token count with the
same tokens, splits every step of the "on" side (the bench raises otherwise), and refuses bad
counts in one line."""

import json

import cli
import pytest


@pytest.mark.timeout(300)
def test_a_small_run_reports_both_sides(capsys, tiny_model):
    model = tiny_model("deepseek_v3", n_routed_experts=8, num_experts_per_tok=2)
    code, out, err = cli.run_cli(capsys, "bench", "tbo", "--model", str(model), "--tokens", "8,16", "--seqs", "4",
                                 "--repeat", "1", "--decode-steps", "1", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert [row["tokens"] for row in r["rows"]] == [8, 16] and r["same_tokens"] is True
    assert all(row[k]["off_s"] > 0 and row[k]["on_s"] > 0 for row in r["rows"] for k in ("prefill", "decode"))
    assert set(r["crossover"]) == {"prefill", "decode"}


def test_counts_must_divide_among_the_prompts(capsys):
    code, _, err = cli.run_cli(capsys, "bench", "tbo", "--tokens", "10", "--seqs", "4")
    assert code == 2 and "must be a multiple of --seqs 4" in err and "Traceback" not in err
