"""n > 1: a request's copies. Each copy is an engine request of its own (its own index, its
own sink, its own result), whose sampler draws from seed + i when the request has a seed
(vLLM's parallel sampling: copy i is reproducible, and copy 0 is the request itself) and
from a seed of its own otherwise. The copies after the first name the first (`fork_of`):
the engine parks them on it, draws each one's first token from the same last prompt row
with its own generator, and forks them from its blocks (engine.batch.scheduler's fork), so
the prompt is computed once."""

from __future__ import annotations

from dataclasses import replace

from atoll.config.sampling import SamplingParams
from atoll.engine.batch.request import Request


def copy_params(params: SamplingParams, i: int) -> SamplingParams:
    """Copy i's params: one copy, seed + i (wrapping at 2**64) when seeded."""
    seed = None if params.seed is None else (params.seed + i) % 2**64
    return replace(params, n=1, seed=seed)


def copies_of(request: Request, ids: list[int], *, share: bool = True) -> list[Request]:
    """The request's params.n copies, copy i with engine index ids[i]; with `share` the
    copies after the first fork from it (without: each computes its prompt, as a
    disaggregated job's engines do, where the first copy may run elsewhere)."""
    n = request.params.n
    if len(ids) != n:
        raise ValueError(f"{len(ids)} ids for {n} copies")
    if n == 1:
        return [replace(request, index=ids[0])]
    return [replace(request, index=ids[i], params=copy_params(request.params, i),
                    fork_of=ids[0] if i and share else None) for i in range(n)]


def expand(requests: list[Request], new_id, *, share: bool = True) -> tuple[list[Request], list[list[int]]]:
    """Every request's copies, each its index from new_id(): (engine requests, and for each
    request the positions of its copies in that list)."""
    out, groups = [], []
    for req in requests:
        ids = [new_id() for _ in range(req.params.n)]
        groups.append(list(range(len(out), len(out) + len(ids))))
        out += copies_of(req, ids, share=share)
    return out, groups


def gather(results: list[dict | None]) -> dict | None:
    """One request's result from its copies' results, in order: copy 0's, with "copies"
    holding every copy's when there are several (None where any copy has none)."""
    if any(r is None for r in results):
        return None
    if len(results) == 1:
        return results[0]
    return {**results[0], "copies": list(results)}
