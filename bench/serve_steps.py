"""`atoll calibrate --steps MODEL`: a model's engine steps measured as it serves, for the
simulator (planner/sim/stepfit.py fits them).

For each layout, `atoll serve` is started as a user starts it (the engine's defaults but
max_num_seqs 32, `--step-trace` to a file), and fixed lists of requests are streamed to it
over HTTP by `atoll bench serve`'s own client, one list after another: N requests of 32 prompt
tokens decoding together (N = 1, 2, 4, 8, 16, 32), and of 480 (N = 1, 4, 16), one of 480 beside
N - 1 of 32 (N = 4, 16), long prompts alone and in fours (a full
chunk budget), and prompts joining while others decode (chunks beside a few decode rows, and
beside a crowd of them), at contexts from tens to two thousand tokens. The lists run three times: the first pass compiles
and warms, the other two are fitted (a 2-core machine's speed drifted by 30% between two passes). Each engine's first rank writes every tick's shape and
seconds (engine/rank/trace.py), so a tick is timed with what serving costs beside it: the API
server's process streaming tokens and the client reading them, on the same cores.

"N x LAYOUT" times N replicas of LAYOUT served together (`--data-parallel-size N`), each with
the cores it gets beside the others, as replicas or a 1P1D pair of engines share a machine.
"""

from __future__ import annotations

import asyncio
import math
import os
import tempfile

from atoll.bench.serve_load import run_load, served_model
from atoll.bench.serve_server import Server
from atoll.engine.rank.trace import read_trace
from atoll.errors import LaunchError
from atoll.models.config import ModelConfig
from atoll.parallel.layout import Layout
from atoll.planner.sim.load import BenchRequest
from atoll.planner.sim.stepfit import fit

MAX_NUM_SEQS = 32
JOIN_RATE = 6.0  # requests a second in the list of prompts joining others as they decode
CROWD, CROWD_RATE = 24, 8.0  # prompts joining while up to about twenty others decode
TIMED_PASSES = 2  # after the warm pass: a machine's speed drifts by tens of percent between minutes


def request_lists(vocab: int, *, quick: bool = False, max_len: int = 4096,
                  copies: int = 1) -> list[tuple[list[BenchRequest], float]]:
    """The lists each pass streams, one after another: (requests, arrival rate; inf: all at once);
    no prompt longer than a model of max_len positions takes with its output. copies: the
    replicas served together, each given a list's rows (its requests interleaved, its rate
    multiplied), so that "2 x TP1" measures each engine at the row counts TP1 is measured at."""
    counter = iter(range(1 << 30))

    def ids(n: int) -> list[int]:
        i = next(counter)
        return [(7919 * i + 104729 * j) % (vocab - 2) + 1 for j in range(n)]

    sets = [_lists(ids, quick, max_len) for _ in range(copies)]
    return [([r for group in zip(*(reqs for reqs, _ in same)) for r in group], same[0][1] * copies)
            for same in zip(*sets)]


def _lists(ids, quick: bool, max_len: int) -> list[tuple[list[BenchRequest], float]]:
    decode = 6 if quick else 24
    longest = max_len - decode - 1
    out = [([BenchRequest(ids(32), decode) for _ in range(n)], math.inf)
           for n in ((1, 4, 16) if quick else (1, 2, 4, 8, 16, 32))]
    # the same row counts at a longer context, so that the rows' cost and the context's part apart
    out += [([BenchRequest(ids(min(480, longest)), decode) for _ in range(n)], math.inf)
            for n in ((4,) if quick else (1, 4, 16))]
    # one long context decoding beside short ones: the compiled step reads every row up to the
    # longest, which this tells apart from each row reading its own (StepFit.decode_keys)
    out += [([BenchRequest(ids(min(480, longest)), decode)] + [BenchRequest(ids(32), decode) for _ in range(n - 1)],
             math.inf) for n in ((8,) if quick else (4, 16))]
    for n, length in (((1, 512),) if quick else ((1, 512), (1, 2000), (4, 512))):
        out.append(([BenchRequest(ids(min(length, longest)), 4) for _ in range(n)], math.inf))
    joining = [BenchRequest(ids(min(256 if k % 2 else 64, longest)), decode) for k in range(4 if quick else 12)]
    out.append((joining, JOIN_RATE))
    if not quick:
        # prompts joining a crowd: a loaded server's chunks run beside tens of decoding rows, which
        # the list above (a few rows at a time) leaves the chunk part's per-row cost to extrapolate
        crowd = [BenchRequest(ids(min(128 if k % 2 else 64, longest)), 2 * decode) for k in range(CROWD)]
        out.append((crowd, CROWD_RATE))
    return out


def served_ticks(model_dir, layout: Layout, copies: int, *, quick: bool = False) -> list[tuple]:
    """(rows, chunk tokens, decode positions, chunk (token, position) pairs, seconds, keys the
    tick's decode step read, whether the compiled step ran it) of every tick of the timed passes,
    every engine's: a tick of the compiled decode step read ctx_padded keys, any other its rows' contexts."""
    config = ModelConfig.load(model_dir)
    max_len = min(config.max_position_embeddings, 4096)
    lists = request_lists(config.vocab_size, quick=quick, max_len=max_len, copies=copies)
    fd, trace = tempfile.mkstemp(prefix="atoll-steps-", suffix=".jsonl")
    os.close(fd)
    argv = ["--layout", str(layout), "--max-num-seqs", str(MAX_NUM_SEQS), "--step-trace", trace,
            "--max-model-len", str(max_len)]
    if copies > 1:
        argv += ["--data-parallel-size", str(copies)]
    try:
        with Server(str(model_dir), argv) as url:
            model = served_model(url, str(model_dir))
            for pass_ in range(1 + TIMED_PASSES):
                if pass_ == 1:
                    warm = len(read_trace(trace))
                for requests, rate in lists:
                    results, _ = asyncio.run(run_load(url, model, requests, rate=rate, timeout_s=1800))
                    bad = [r.error for r in results if not r.success]
                    if bad:
                        raise LaunchError(f"calibrate --steps: the server failed a request at {layout}: {bad[0]}")
        ticks = read_trace(trace)[warm:]
    finally:
        os.unlink(trace)
    return [(rows, chunk, ctx, attended, seconds, padded if graph else ctx, graph)
            for _, rows, chunk, ctx, attended, seconds, padded, graph in ticks if rows or chunk]


def measure_steps(model_dir, layouts: list[str], *, quick: bool = False, bar=None) -> dict:
    """{layout: StepFit.to_dict()} for the model on this machine, served; "N x LAYOUT" times N
    replicas served together."""
    out = {}
    for text in layouts:
        copies, _, one = text.rpartition("x")
        lay = Layout.parse(one.strip())
        copies = int(copies) if copies.strip() else 1
        key = f"{copies} x {lay}" if copies > 1 else str(lay)
        if bar is not None:
            bar.set_postfix_str(f"steps {key}")
        out[key] = fit(served_ticks(model_dir, lay, copies, quick=quick)).to_dict()
        if bar is not None:
            bar.update()
    return out
