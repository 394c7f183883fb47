"""`atoll serve --plan`: a plan from the SLO search (`atoll plan --goodput --save`) carries the
whole deployment (planner.sim.deploy.Deployment); its engine options become serve's flags."""

from __future__ import annotations

import json

from atoll.errors import ConfigError

KV_NAMES = {"fp8": "fp8", "fp8_e4m3": "fp8_e4m3", "fp8_e5m2": "fp8_e5m2", "int8": "int8"}  # else the runtime's auto


def apply_deployment(args, deployment: dict) -> list[str]:
    """Sets args from a saved deployment; returns what it set, as `flag value` words. The
    layout and replicas come from the plan itself (cli/serve.py); xPyD sets --prefill/--decode."""
    if not deployment:
        return []
    d = dict(deployment)
    if d.get("prefill") and str(getattr(args, "layout", "") or "").lower() not in ("", "auto", "none"):
        raise ConfigError("--plan holds an xPyD deployment: drop --layout (its prefill and decode layouts are the plan's)")
    set_: list[str] = []

    def put(name: str, flag: str, value) -> None:
        setattr(args, name, value)
        set_.append(f"{flag} {value}")

    put("max_num_seqs", "--max-num-seqs", d["max_num_seqs"])
    if d.get("max_num_batched_tokens"):
        put("max_num_batched_tokens", "--max-num-batched-tokens", d["max_num_batched_tokens"])
    put("block_size", "--block-size", d["block_size"])
    if d.get("prefix_caching"):
        put("enable_prefix_caching", "--enable-prefix-caching", True)
    if d.get("kv_dtype") in KV_NAMES:
        put("kv_cache_dtype", "--kv-cache-dtype", KV_NAMES[d["kv_dtype"]])
    if d.get("num_blocks"):
        put("num_blocks", "--num-blocks", d["num_blocks"])
    if d.get("kv_offload_gb"):  # the other tiers need a directory or a URL: the plan cannot name them
        put("kv_offload_gb", "--kv-offload-gb", d["kv_offload_gb"])
    if d.get("spec_tokens"):
        put("speculative_config", "--speculative-config",
            json.dumps({"method": "ngram", "num_speculative_tokens": d["spec_tokens"]}))
    if d.get("prefill"):
        put("prefill", "--prefill", d["prefill"])
        put("decode", "--decode", d["decode"])
        put("prefill_replicas", "--prefill-replicas", d["prefill_replicas"])
        put("decode_replicas", "--decode-replicas", d["decode_replicas"])
        if d.get("min_prompt_tokens"):
            put("disagg_min_prompt_tokens", "--disagg-min-prompt-tokens", d["min_prompt_tokens"])
        if d.get("colocated_replicas"):
            put("colocated_replicas", "--colocated-replicas", d["colocated_replicas"])
    return set_
