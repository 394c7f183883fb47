"""The one generation job the launcher end-to-end tests run under every launcher."""

PROMPTS = [[5, 7, 9], [100, 3], [42]]


def generate_requests(model_dir):
    """(spec, requests) for greedy TP2PP2 generation; the same on every rank and process."""
    from atoll.launch.api import LLM
    from atoll.engine.sample.sampler import SamplingParams

    llm = LLM(model_dir, layout="TP2PP2")
    requests = llm.prepare(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    return llm.spec(), requests


def tokens(results) -> list[list[int]]:
    return [list(r["token_ids"]) for r in results]


def local_tokens(model_dir) -> list[list[int]]:
    """The local launcher's tokens for the job; cached beside the (per-session) tiny model."""
    import json
    from pathlib import Path

    from atoll.engine.rank.job import EngineJob
    from atoll.engine.worker import worker
    from atoll.launch.local import run_local

    cache = Path(model_dir) / "launcher-test-local-tokens.json"
    if not cache.exists():
        spec, requests = generate_requests(model_dir)
        cache.write_text(json.dumps(tokens(run_local(worker, 4, EngineJob.colocated(spec), requests=requests, timeout_s=300)[0])))
    return json.loads(cache.read_text())
