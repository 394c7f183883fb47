"""The compiled decode step: a decode micro-batch padded to a bucket and run through
`torch.compile`d code that sees tensors only.

Buckets. A decode micro-batch of n sequences runs at the smallest sequence bucket >= n of 2,
4, 8, ... and max_num_seqs (the last bucket; MIN_ROWS below says why not 1), or at 1 when
max_num_seqs is 1; its block tables are padded to a power-of-two number of blocks (at least
2, at most max_model_len / block_size). Padding rows write their key and value into a
scratch block that the schedulers never hand out (the cache's last block), attend to it
alone, and their outputs are dropped. The step reads per-bucket input buffers (token ids or
received activations, positions, cache slots, context lengths) and a block table, filled by
device copies from the micro-batch's metadata: no `.item()`, `.tolist()` or host list
inside, no shape that depends on the data.

Graphs: one per stage, compiled on first use (a 30-layer stage takes ~40-60 s of inductor on
a 2-core CPU), the sequence count and the block-table width symbolic (`mark_dynamic`), so it
serves every bucket and context length without recompiling: a graph per (sequences, blocks)
pair would multiply the compiles, and with freezing the packed weights. With max_num_seqs 1
(a latency run, as `atoll bench --batch 1` configures it) the one graph is static at one row
and every linear is a row reduction (layers.packed.row_product), which inductor turns into
one vectorised pass over the weight: SmolLM2's 121 linears took 15-23 ms that way against
26-29 ms through oneDNN at two rows, side by side on a 2-core AMD EPYC. It stays out of the
shared graph: a run whose batch drains to one sequence would stall a minute compiling a
second graph for its last tokens. The buckets still bound the shapes that run (engine.graphs
captures one CUDA graph per bucket). Rank 0 prints a line on stderr whenever the step
compiles: how long it took, and the buckets.

Collectives. TP's all_reduce / all_gather (comm.Group -> torch.distributed) are traced:
dynamo turns them into functional collectives, which inductor calls in place in the graph,
over gloo on CPU (NCCL on CUDA, where the same graph is capturable). PP's send/recv stay
outside: the runner receives into the bucket's buffer and sends the real rows on.

CPU: inductor with freezing (`torch._inductor.config.freezing`): parameters become constants
and every linear weight is prepacked once for oneDNN (inductor packs for oneDNN, not MKL as
layers/packed.py does, when the row count is symbolic; on this AMD EPYC oneDNN's float32
GEMM streams SmolLM2's weights 1.5-2x faster than MKL at 1-16 rows, and F.linear, which
transformers and the eager step run, is MKL). Freezing costs that packed copy of the
weights, so it is used only when a copy on every rank of the machine fits in a quarter of
its available memory; and frozen graphs hold packed tensors, which inductor's FX graph cache
cannot store: a frozen graph is compiled again by every run (the one-row graph packs nothing
and is cached: 52 s the first run, 19 s the next, for SmolLM2). ATOLL_COMPILE_FREEZING=0
turns freezing off (F.linear's MKL then, ~2x slower here); the graph is then cached on disk
(TORCHINDUCTOR_CACHE_DIR, default $ATOLL_CACHE/inductor or ~/.cache/atoll/inductor) and a
later run loads it in seconds. On CUDA the decode step is captured as CUDA graphs instead
(engine.graphs).

Switches: EngineConfig.enforce_eager (--enforce-eager, LLM(enforce_eager=True)) or
ATOLL_ENFORCE_EAGER=1 run every step eagerly, with no compile at all.
"""

from __future__ import annotations

import os
import sys
import time

import torch

from atoll.layers.attention import StaticDecode
from atoll.layers.rotary import RotaryEmbedding

EAGER_ENV = "ATOLL_ENFORCE_EAGER"
# one sequence runs padded to two: dynamo would specialise a dimension of size 1 (a second
# graph, MKL-packed); at two rows it shares the symbolic, oneDNN-packed one, which is faster
# than MKL at one row on an AMD EPYC (23-27 ms against 35 ms for SmolLM2's linears)
MIN_ROWS = 2
FREEZING_ENV = "ATOLL_COMPILE_FREEZING"


def eager_forced(enforce_eager: bool = False) -> bool:
    return enforce_eager or os.environ.get(EAGER_ENV, "0").strip().lower() in ("1", "true", "yes", "on")


def seq_buckets(max_num_seqs: int, smallest: int = 1) -> list[int]:
    """smallest, 2 x smallest, 4 x smallest, ... below max_num_seqs, then max_num_seqs (or
    just smallest, when max_num_seqs is not above it)."""
    out, b = [], smallest
    while b < max_num_seqs:
        out.append(b)
        b *= 2
    return out + [max(max_num_seqs, smallest)]


def block_bucket(blocks: int, max_blocks: int) -> int:
    """The power of two >= blocks (at least 2: a width of 1 would be specialised by dynamo),
    capped at max_blocks."""
    b = 2
    while b < blocks:
        b *= 2
    return min(b, max_blocks)


def inductor_cache_dir() -> str:
    """Where inductor keeps compiled graphs: the user's TORCHINDUCTOR_CACHE_DIR, else ours
    (importing torch._inductor sets the variable to its default in /tmp: that one is not the user's)."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    from atoll.models.gguf import cache_dir

    theirs = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if theirs and os.path.abspath(theirs) != os.path.abspath(default_cache_dir()):
        return theirs
    return str(cache_dir() / "inductor")


class Bucket:
    """One sequence bucket's static inputs."""

    def __init__(self, seqs: int, scratch: int, hidden: int | None, dtype, device):
        long = dict(dtype=torch.long, device=device)
        if hidden is None:
            self.x = torch.zeros(seqs, **long)  # token ids (first stage)
        else:
            self.x = torch.zeros(seqs, hidden, dtype=dtype, device=device)  # received activations
        self.positions = torch.zeros(seqs, **long)
        self.block = torch.full((seqs,), scratch, **long)
        self.offset = torch.zeros(seqs, **long)
        self.lengths = torch.ones(seqs, **long)
        self.scratch = scratch

    def fill(self, n: int, x: torch.Tensor, meta) -> None:
        """Rows :n from the micro-batch; rows n: padding again (a row a larger batch used
        last step would otherwise rewrite that sequence's cache slot)."""
        self.x[:n] = x
        self.x[n:] = 0
        self.positions[:n] = meta.positions
        self.positions[n:] = 0
        self.block[:n], self.offset[:n] = meta.slots
        self.block[n:], self.offset[n:] = self.scratch, 0
        self.lengths[:n] = meta.context_lens()
        self.lengths[n:] = 1


class CompiledDecode:
    """The runner's decode step for micro-batches `takes` accepts; `__call__` returns what
    model(x, meta, cache) returns for them."""

    def __init__(self, model, cache, *, max_num_seqs: int, max_model_len: int, block_size: int,
                 scratch_block: int, rank: int = 0, freezing: bool = True):
        import torch._dynamo
        import torch._inductor.config as inductor

        os.environ["TORCHINDUCTOR_CACHE_DIR"] = inductor_cache_dir()  # read at each compile
        self.model, self.cache = model, cache
        self.block_size, self.scratch = block_size, scratch_block
        self.max_blocks = -(-max_model_len // block_size)
        # max_num_seqs 1 (a latency run): one static one-row graph, whose linears stream their
        # weights as row reductions (layers.packed.row_product); else the shared symbolic graph
        self.buckets = [1] if max_num_seqs == 1 else seq_buckets(max_num_seqs, smallest=MIN_ROWS)
        self.first_stage = model.ctx.is_first_stage
        p = next(model.parameters())
        self.hidden = None if self.first_stage else model.config.hidden_size
        self.dtype, self.device = p.dtype, p.device
        self.rank = rank
        self.freezing = freezing
        inductor.freezing = freezing  # read while dynamo traces (parameters as constants) and by inductor
        limit = 4  # one graph, and room for a recompile the guards ask for
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, limit)
        self._inputs: dict[int, Bucket] = {}
        self.compiles: list[tuple[int, float]] = []  # (bucket, seconds) of each call that compiled
        self._rotaries = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
        # static but for the dimensions __call__ marks dynamic; no graph break allowed
        self._step = torch.compile(self._forward, dynamic=False, fullgraph=True)

    def takes(self, mb) -> bool:
        return bool(mb.chunks) and mb.is_decode and len(mb.chunks) <= self.buckets[-1]

    def _forward(self, x, positions, block, offset, tables, lengths):
        for r in self._rotaries:  # its per-step memo is set by the first layer; the trace never reads an old one
            r._memo = None
        meta = StaticDecode(positions, (block, offset), tables, lengths, self.block_size)
        return self.model(x, meta, self.cache)

    def __call__(self, x: torch.Tensor, mb) -> torch.Tensor:
        """x: [n] token ids (first stage) or [n, hidden] activations -> [n, ...] rows."""
        meta, n = mb.meta, len(mb.chunks)
        size = next(b for b in self.buckets if b >= n)
        inp = self._inputs.get(size)
        if inp is None:
            inp = self._inputs[size] = Bucket(size, self.scratch, self.hidden, self.dtype, self.device)
        blocks = -(-(max(meta.start_list) + 1) // self.block_size)  # host list: no sync
        width = block_bucket(blocks, self.max_blocks)
        inp.fill(n, mb.ids if x is None else x, meta)
        # contiguous at every width (a view of a wider buffer would guard on its stride)
        tables = torch.full((size, width), self.scratch, dtype=torch.long, device=self.device)
        tables[:n, :blocks] = meta.block_tables[:, :blocks]
        if self.max_blocks > 2:  # one graph for every width 2..max_blocks
            torch._dynamo.mark_dynamic(tables, 1, min=2, max=self.max_blocks)
        if size > 1:  # one graph for every bucket (the one-row graph is static)
            for t in (inp.x, inp.positions, inp.block, inp.offset, inp.lengths, tables):
                torch._dynamo.mark_dynamic(t, 0, min=MIN_ROWS, max=max(4, self.buckets[-1]))
        if not self.compiles and not getattr(self, "_announced", False) and self.rank == 0:
            self._announced = True  # the first call compiles: say why the run pauses here
            print("atoll: compiling the decode step (up to a minute on a small CPU; --enforce-eager skips it)",
                  file=sys.stderr, flush=True)
        graphs, t0 = _graph_count(), time.perf_counter()
        out = self._step(inp.x, inp.positions, inp.block, inp.offset, tables, inp.lengths)
        if _graph_count() != graphs:  # this call compiled
            self.compiles.append((size, time.perf_counter() - t0))
            self._report()
        return out[:n]

    def _report(self) -> None:
        if self.rank != 0:
            return
        size, seconds = self.compiles[-1]
        how = ("frozen weights" if self.freezing else
               f"cached in {os.environ['TORCHINDUCTOR_CACHE_DIR']}")
        again = f" (compile {len(self.compiles)}: a recompile)" if len(self.compiles) > 1 else ""
        print(f"atoll: compiled the decode step in {seconds:.1f} s{again}, inductor, {how}: one graph for "
              f"buckets of {', '.join(map(str, self.buckets))} sequences x up to {self.max_blocks} blocks "
              f"(first run at {size})", file=sys.stderr, flush=True)

    @property
    def buckets_run(self) -> list[int]:
        return sorted(self._inputs)


def _graph_count() -> int:
    """Graphs dynamo has compiled in this process (the compiled step is the only user)."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]


def freezing_fits(model, ranks_here: int) -> bool:
    """Whether a packed copy of the weights on every rank of this machine fits in a quarter of
    its available memory (as layers/packed.py's rule); ATOLL_COMPILE_FREEZING=0: no."""
    if os.environ.get(FREEZING_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    from atoll.engine.blocks import copy_fits

    return copy_fits(sum(p.numel() * p.element_size() for p in model.parameters() if p.dim() == 2), ranks_here)


def build(runner):
    """The runner's decode step: CUDA graphs per bucket on CUDA (engine.graphs), inductor on
    the CPU; None (every step eager): eager forced, an MoE model on the CPU, or one with
    dp > 1 on CUDA (its fixed-shape exchange needs one bucket on every DP rank)."""
    spec = runner.spec
    if eager_forced(spec.engine.enforce_eager) or runner.config.is_mla:  # MLA (DeepSeek) decodes eagerly
        return None
    if runner.device.type == "cuda":
        if runner.config.is_moe and runner.ctx.layout.dp > 1:
            return None  # the fixed-shape MoE exchange needs every DP rank at one bucket: not yet
        from atoll.engine.graphs import GraphedDecode

        return GraphedDecode(runner.model, runner.cache, max_num_seqs=spec.engine.max_num_seqs,
                             max_model_len=spec.max_model_len, block_size=spec.engine.block_size,
                             scratch_block=runner.num_blocks, rank=runner.ctx.rank)
    if runner.device.type != "cpu" or runner.config.is_moe:
        return None
    _thread_lock_for_tqdm()
    return CompiledDecode(runner.model, runner.cache, max_num_seqs=spec.engine.max_num_seqs,
                          max_model_len=spec.max_model_len, block_size=spec.engine.block_size,
                          scratch_block=runner.num_blocks, rank=runner.ctx.rank,
                          freezing=freezing_fits(runner.model, runner.ranks_here))


def _thread_lock_for_tqdm() -> None:
    """inductor's compile shows a tqdm bar, whose default lock is a multiprocessing semaphore;
    a rank leaves with os._exit, so that semaphore would be reported leaked at the job's end.
    A thread lock serves a rank, which draws no bar from other processes."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
