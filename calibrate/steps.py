"""`atoll calibrate --steps MODEL`: a model's engine steps measured on this machine, for the
simulator (planner/sim/stepfit.py fits them).

For each layout the ranks are started as a served engine starts them (local launcher, the
engine's default options: the compiled CPU step, its tuned products, max_num_seqs 32) and run
fixed lists of requests through the rank loop twice: the first pass compiles and warms, the
second is timed. Rank 0 records every tick's shape and seconds (EngineCore's trace). The lists
cover what serving asks of a step: N requests of 32 prompt tokens decoding together (N = 1,
2, 4, 8, 16, 32), long prompts alone and in fours (a full chunk budget), and prompts joining
while others decode (chunks beside decode rows), at contexts from tens to two thousand tokens.
"""

from __future__ import annotations

import os

from atoll.config.sampling import SamplingParams
from atoll.engine.batch.request import Request
from atoll.engine.rank.loop import run_batch
from atoll.engine.rank.run_spec import RunSpec
from atoll.engine.rank.runner import ModelRunner
from atoll.launch.local import run_local
from atoll.models.config import ModelConfig
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext
from atoll.planner.sim.stepfit import fit

MAX_NUM_SEQS = 32


def requests_for(vocab: int, *, quick: bool = False) -> list[list[Request]]:
    """The lists of requests each pass runs, one list at a time."""
    rng_ids = (lambda i, n: [(7919 * i + 104729 * j) % (vocab - 2) + 1 for j in range(n)])
    out, index = [], 0

    def batch(specs):  # [(prompt tokens, output tokens, arrival step)]
        nonlocal index
        reqs = []
        for n, o, at in specs:
            reqs.append(Request(index, rng_ids(index, n), SamplingParams(max_tokens=o, ignore_eos=True), at))
            index += 1
        return reqs

    decode = 6 if quick else 24
    for n in ((1, 4, 16) if quick else (1, 2, 4, 8, 16, 32)):
        out.append(batch([(32, decode, 0)] * n))
    for n, length in (((1, 512),) if quick else ((1, 512), (1, 2000), (4, 512))):
        out.append(batch([(length, 4, 0)] * n))
    joining = [(256 if k % 2 else 64, decode, 3 * k) for k in range(4 if quick else 12)]
    out.append(batch(joining))
    return out


def steps_rank(rank: int, world: int, model_dir: str, layout: str, quick: bool) -> list | None:
    """On every rank: the runner, both passes; rank 0 returns (rows, chunk tokens, ctx, attended,
    seconds) for each tick of the timed pass."""
    lay = Layout.parse(layout)
    config = ModelConfig.load(model_dir)
    lists = requests_for(config.vocab_size, quick=quick)
    longest = max(len(r.prompt_token_ids) + r.params.max_tokens for rs in lists for r in rs)
    spec = RunSpec.of(model_dir, layout, max_model_len=min(config.max_position_embeddings, 4096),
                      max_num_seqs=MAX_NUM_SEQS)
    assert longest <= spec.max_model_len
    ctx = ParallelContext.create(lay, rank, "cpu") if world > 1 else ParallelContext.single("cpu")
    runner = ModelRunner(spec, ctx)
    for reqs in lists:  # the warm pass: every bucket the timed pass reaches is compiled here
        run_batch(runner, reqs)
    trace: list = []
    for reqs in lists:
        run_batch(runner, reqs, trace=trace)
    if rank != 0:
        return None
    return [(s.rows, s.chunk_tokens, s.ctx_sum, s.attended_sum, sec) for s, sec in trace]


def measure_steps(model_dir, layouts: list[str], *, quick: bool = False, bar=None) -> dict:
    """{layout: StepFit.to_dict()} for the model on this machine; "N x LAYOUT" times one engine
    with the threads each of N such engines gets on this machine's cores."""
    out = {}
    cores = os.cpu_count() or 1
    for text in layouts:
        copies, _, one = text.rpartition("x")
        lay = Layout.parse(one.strip())
        copies = int(copies) if copies.strip() else 1  # "2 x TP1": a TP1 engine with the threads it gets beside another
        key = f"{copies} x {lay}" if copies > 1 else str(lay)
        if bar is not None:
            bar.set_postfix_str(f"steps {key}")
        samples = run_local(steps_rank, lay.world_size, str(model_dir), str(lay), quick,
                            threads=max(1, cores // (lay.world_size * copies)), timeout_s=1800)[0]
        out[key] = fit(samples).to_dict()
        if bar is not None:
            bar.update()
    return out
