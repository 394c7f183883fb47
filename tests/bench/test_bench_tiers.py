"""`atoll bench serve --scenario kv-tiers`: multi-turn chat on a pool too small for it, with no
tiers, a host tier, host plus disk, and a restart on that disk directory, each on a server of its
own (bench/serve_tiers.py)."""

import json

import pytest
from cli import run_cli


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_multi_turn_chat_finds_its_history_in_the_tiers_with_the_same_answers(capsys, tiny_model):
    code, out, err = run_cli(capsys, "bench", "serve", "--scenario", "kv-tiers", "--model", tiny_model("llama"),
                             "--num-prompts", "8", "--turns", "3", "--input-len", "40", "--user-len", "10",
                             "--output-len", "8", "--num-blocks", "16", "--max-model-len", "128",
                             "--max-concurrency", "2", "--kv-offload-gb", "0.05", "--json")
    assert code == 0, err
    r = json.loads(out)
    assert r["same_answers"] and r["turns"] == 3
    none, host, disk = (r["sides"][k] for k in ("no tiers", "host", "host + disk"))
    assert all(s["failed"] == 0 and s["turns"] == 24 for s in (none, host, disk))
    assert set(none["hit_rate"]) == {"device"}  # nothing below the pool
    # every later turn's history (two full blocks and more) was let go by the 16-block pool and
    # is found in host memory: fewer prompt tokens computed than without tiers
    assert host["hit_rate"]["host"] > 0.3 and host["prefill_tokens_computed"] < none["prefill_tokens_computed"]
    assert disk["prefill_tokens_computed"] < none["prefill_tokens_computed"]
    # the restarted server finds every first prompt's two full blocks on disk; the cold one none
    again = r["sides"]["restart on disk"]
    assert again["failed"] == 0 and disk["first_turns_cached_tokens"] == 0
    assert again["first_turns_cached_tokens"] == 8 * 32 and again["hit_rate"]["disk"] > 0


def test_kv_tiers_starts_its_own_servers(capsys, tiny_model):
    code, _, err = run_cli(capsys, "bench", "serve", "--scenario", "kv-tiers", "--model", tiny_model("llama"),
                           "--url", "http://127.0.0.1:9")
    assert code == 2 and err.strip().endswith("--scenario kv-tiers starts its own servers (one per side): drop --url")
