"""The decode step on CUDA: captured once per sequence bucket as a CUDA graph, replayed each step.

A decode micro-batch of n sequences runs at the smallest bucket >= n of 1, 2, 4, 8, ... and
max_num_seqs. Each bucket owns static input buffers (token ids or received activations,
positions, cache slots, context lengths, and a block table max_model_len / block_size wide);
a step copies the micro-batch's metadata into them, padding rows write into the cache's
scratch block and attend to it alone (as in engine.compiled), and replays the bucket's graph.
One width of table serves every context: the Triton paged-attention kernel reads a
sequence's blocks only up to its length, so the width costs memory, not time.

Capture happens on the first decode step, for every bucket at once, largest first, all graphs
sharing one memory pool; two eager forwards on a side stream first (Triton compiles its
kernels, cuBLAS makes its workspaces). The forward captured is the eager one, whose hot ops
on CUDA are Triton kernels (RMSNorm, rotary, paged attention) and cuBLAS GEMMs: the graph
removes the ~15 launches per layer and the Python between them, which is where a batch-1
decode step loses its time on a GPU; inductor is not run on CUDA. TP's all_reduce and
all_gather are captured as NCCL kernels; PP's send/recv stay outside (the runner receives
into the bucket's buffer and sends a copy of the output rows on).

On the CPU the same class runs without capture (`replay` calls the forward on the static
buffers): that proves the buffers, padding and bucket choice against the eager step in the
tests; the CPU's own compiled path is engine.compiled.
"""

from __future__ import annotations

import sys
import time

import torch

from atoll.engine.compiled import Bucket, seq_buckets
from atoll.layers.attention import StaticDecode
from atoll.layers.rotary import RotaryEmbedding

WARMUP = 2  # eager forwards on a side stream before a capture


class GraphedDecode:
    """The runner's decode step for micro-batches `takes` accepts; `__call__` returns what
    model(x, meta, cache) returns for them."""

    def __init__(self, model, cache, *, max_num_seqs: int, max_model_len: int, block_size: int,
                 scratch_block: int, rank: int = 0, capture: bool | None = None):
        self.model, self.cache = model, cache
        self.block_size, self.scratch = block_size, scratch_block
        self.max_blocks = -(-max_model_len // block_size)
        self.buckets = seq_buckets(max_num_seqs, smallest=1)
        p = next(model.parameters())
        self.device, self.dtype = p.device, p.dtype
        self.capture = self.device.type == "cuda" if capture is None else capture
        self.hidden = None if model.ctx.is_first_stage else model.config.hidden_size
        self.last_stage = model.ctx.is_last_stage
        self.rank = rank
        self._rotaries = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
        self._inputs: dict[int, Bucket] = {}
        self._graphs: dict[int, tuple] = {}  # bucket -> (graph or None, output buffer)
        self._used: set[int] = set()
        self.compiles: list[tuple[int, float]] = []  # (buckets, seconds) of the capture
        self.freezing = False
        self.error: str | None = None  # why capture failed, if it did (every bucket then runs eagerly)

    def takes(self, mb) -> bool:
        return bool(mb.chunks) and mb.meta.is_decode and len(mb.chunks) <= self.buckets[-1]

    def _forward(self, inp: Bucket) -> torch.Tensor:
        for r in self._rotaries:  # recomputed from the bucket's positions inside the graph
            r._memo = None
        meta = StaticDecode(inp.positions, (inp.block, inp.offset), inp.tables, inp.lengths, self.block_size)
        return self.model(inp.x, meta, self.cache)

    def _capture_all(self) -> None:
        for size in self.buckets:
            self._inputs[size] = Bucket(size, self.scratch, self.hidden, self.dtype, self.device, width=self.max_blocks)
        try:
            self._capture_buckets()
        except Exception as e:  # noqa: BLE001 - say why, and run every bucket eagerly
            self.error = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"[:300]
            self.capture = False
            self._graphs = {size: (None, None) for size in self.buckets}
            print(f"atoll: CUDA graph capture failed ({self.error}); the decode step runs eagerly",
                  file=sys.stderr, flush=True)

    def _capture_buckets(self) -> None:
        t0 = time.perf_counter()
        pool = None
        for size in reversed(self.buckets):  # largest first: the smaller graphs reuse its pool
            inp = self._inputs[size]
            if not self.capture:
                self._graphs[size] = (None, None)
                continue
            side = torch.cuda.Stream(self.device)
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                for _ in range(WARMUP):  # padding rows only: they write the scratch block
                    self._forward(inp)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                out = self._forward(inp)
            pool = graph.pool()
            self._graphs[size] = (graph, out)
        if self.capture:
            torch.cuda.synchronize(self.device)
        self.compiles.append((len(self.buckets), time.perf_counter() - t0))
        if self.rank == 0 and self.capture:
            print(f"atoll: captured the decode step as CUDA graphs in {self.compiles[-1][1]:.1f} s: buckets of "
                  f"{', '.join(map(str, self.buckets))} sequences x {self.max_blocks} blocks "
                  "(--enforce-eager: no graphs)", file=sys.stderr, flush=True)

    def __call__(self, x: torch.Tensor, mb) -> torch.Tensor:
        """x: [n] token ids (first stage) or [n, hidden] activations -> [n, ...] rows."""
        if not self._graphs:
            self._capture_all()
        meta, n = mb.meta, len(mb.chunks)
        size = next(b for b in self.buckets if b >= n)
        self._used.add(size)
        inp = self._inputs[size]
        blocks = -(-(max(meta.start_list) + 1) // self.block_size)  # host list: no sync
        inp.fill(n, x, meta)
        inp.tables[:n, :blocks] = meta.block_tables[:, :blocks]
        inp.tables[n:] = self.scratch
        graph, out = self._graphs[size]
        if graph is None:
            out = self._forward(inp)
        else:
            graph.replay()
        # the next replay rewrites the output buffer: a stage that sends it on sends a copy
        return out[:n] if self.last_stage else out[:n].clone()

    @property
    def buckets_run(self) -> list[int]:
        return sorted(self._used)
