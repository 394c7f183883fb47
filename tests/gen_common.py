"""The one generation job the launcher end-to-end tests run under every launcher."""

PROMPTS = [[5, 7, 9], [100, 3], [42]]


def generate_requests(model_dir):
    """(spec, requests) for greedy TP2PP2 generation; the same on every rank and process."""
    from atoll.engine.llm import LLM
    from atoll.engine.sampling import SamplingParams

    llm = LLM(model_dir, layout="TP2PP2")
    requests = llm.prepare(PROMPTS, SamplingParams(max_tokens=8, ignore_eos=True))
    return llm.spec(), requests


def tokens(results) -> list[list[int]]:
    return [list(r["token_ids"]) for r in results]
