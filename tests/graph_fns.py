"""Rank functions for the CUDA-graph decode step's buffers (engine.step.graphs): the same
runner decodes eagerly, then through the graph buffers, captured where the rank is on CUDA
(examples/gpu_check.sh runs the TP1 tests there), run without capture on the CPU."""

from atoll.engine.rank.loop import run_batch
from atoll.engine.rank.runner import ModelRunner
from atoll.engine.step.graphs import GraphedDecode
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext


class Counted(GraphedDecode):
    """GraphedDecode that counts its steps of padding rows only (a DP replica with nothing to
    decode while another decodes: MoE with DP)."""

    padded = 0

    def __call__(self, x, mb):
        self.padded += not mb.chunks
        return super().__call__(x, mb)


def graph_buffers(runner, rank: int) -> GraphedDecode:
    """The runner's decode step as GraphedDecode (captured on CUDA only), its buckets up to
    max_num_seqs x (1 + K) rows (a verify step's rows), as engine.step.policy builds it."""
    spec = runner.spec
    return Counted(runner.model, runner.cache, max_num_seqs=spec.engine.max_num_seqs * (1 + (runner.spec_k or 0)),
                   max_model_len=spec.max_model_len, block_size=spec.engine.block_size,
                   scratch_block=runner.num_blocks, rank=rank)


def eager_then_graphed(rank, world, spec, requests):
    """Tokens of the eager step, then of the graph buffers, on one runner; the KV cache's
    largest change between the two runs (padding rows write only the scratch block); the
    buckets run, the ticks the buffers took (runner.graphed_steps), and the graphed run's drafts
    made and accepted under speculation."""
    ctx = ParallelContext.create(Layout.parse(spec.layout), rank) if world > 1 else ParallelContext.single()
    runner = ModelRunner(spec, ctx)
    assert runner.decode_step is None  # conftest: eager by default
    eager = [r and r["token_ids"] for r in run_batch(runner, requests)]
    kv = [t for t in runner.cache.k + runner.cache.v if t is not None]
    eager_kv = [_plain(t)[:runner.num_blocks].clone() for t in kv]
    runner.decode_step = graph_buffers(runner, rank)
    results = run_batch(runner, requests)
    graphed = [r and r["token_ids"] for r in results]
    spec_counts = [sum(r["metrics"].get(k, 0) for r in results if r) for k in ("spec_drafted", "spec_accepted")]
    kv_diff = max(float((_plain(t)[:runner.num_blocks] - e).abs().max()) for t, e in zip(kv, eager_kv))
    return {"eager": eager, "graphed": graphed, "kv_diff": kv_diff, "buckets": runner.decode_step.buckets,
            "run": runner.decode_step.buckets_run, "steps": runner.graphed_steps,
            "padded": runner.decode_step.padded,
            "drafted": spec_counts[0], "accepted": spec_counts[1]}


def _plain(t):
    """A cache tensor's stored values as floats (a quantized cache's raw storage)."""
    return t.data.float()
