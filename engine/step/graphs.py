"""The decode step on CUDA: captured once per sequence bucket as a CUDA graph, replayed each step.

A decode micro-batch of n sequences runs at the smallest bucket >= n of 1, 2, 4, 8, ... and
max_num_seqs; with speculative decoding, a verify step of decoding sequences is a decode step
of one row per position (each sequence's pending token and its K drafts), so the buckets go up
to max_num_seqs x (1 + K) rows and the verify step replays a graph too. Each bucket owns one packed device buffer of longs (token ids, positions, cache
block and offset of the new token, context lengths, and a block table max_model_len /
block_size wide) and its pinned host twin: a step writes the real rows on the host from the
scheduler's chunks (padding rows write into the cache's scratch block and attend to it
alone, as engine.step.decode_step says), copies the buffer in one asynchronous copy and replays the
bucket's graph: three device calls a step (the copy, a received activation's copy under PP,
the replay), since on a GPU each call outside the graph costs as much as a small kernel.
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

MoE layers run their fixed-shape exchange inside the step (SparseMoE.static_exchange:
all_gather or all_reduce over ep, every expert's rows at a fixed shape), since the
all-to-all's split sizes would need the host; the step therefore needs every DP rank of a
stage at the same bucket: with dp > 1 the replicas agree on it each step (runner.agree sets
MicroBatch.step_rows, the largest replica's rows; a replica with nothing to decode steps a
bucket of padding rows, and where any replica cannot take the step every one runs eagerly).
MLA layers (DeepSeek) run their absorbed decode over the latent cache on the same static
tables (layers/mla.py; on CUDA the Triton MLA kernel, plain, int8 or fp8 cache).

On the CPU the same class runs without capture (`replay` calls the forward on the static
buffers): that proves the buffers, padding and bucket choice against the eager step in the
tests; the CPU's own compiled path is engine.step.compiled.
"""

from __future__ import annotations

import sys
import time

import torch

from atoll.engine.step.decode_step import DecodeStep

WARMUP = 2  # eager forwards on a side stream before a capture


class Packed:
    """One bucket's inputs as views of one device buffer of longs, filled from a host twin
    (pinned on CUDA) in one copy; `x` holds the received activations on a later stage."""

    FIELDS = ("ids", "positions", "block", "offset", "lengths")

    def __init__(self, seqs: int, width: int, scratch: int, hidden: int | None, dtype, device):
        size = seqs * (len(self.FIELDS) + width)
        self.device_buf = torch.zeros(size, dtype=torch.long, device=device)
        pinned = device.type == "cuda"
        self.host = torch.zeros(size, dtype=torch.long, pin_memory=pinned)
        self.np = self.host.numpy()
        n = len(self.FIELDS) * seqs
        parts = self.device_buf[:n].view(len(self.FIELDS), seqs)
        self.ids, self.positions, self.block, self.offset, self.lengths = parts
        self.tables = self.device_buf[n:].view(seqs, width)
        self.host_rows = self.np[:n].reshape(len(self.FIELDS), seqs)
        self.host_tables = self.np[n:].reshape(seqs, width)
        self.x = None if hidden is None else torch.zeros(seqs, hidden, dtype=dtype, device=device)
        self.seqs, self.scratch = seqs, scratch
        self.copied = torch.cuda.Event() if pinned else None  # the last copy out of the host twin
        self.fill_host([], 0)  # every row padding: what the warm-up and the capture run on
        self.device_buf.copy_(self.host)

    def fill_host(self, chunks, block_size: int) -> None:
        """The decode chunks' rows, one per new token (a verify step's pending token and each
        draft: a row at its own position, attending to the cache up to it), then padding rows
        (token 0 at position 0, writing the scratch block's first slot, attending to it alone)."""
        if self.copied is not None:
            self.copied.synchronize()  # the copy of the last step has left the host buffer
        ids, pos, block, offset, lengths = self.host_rows
        tables = self.host_tables
        i = 0
        for c in chunks:
            blocks = c.seq.blocks
            for j, token in enumerate(c.token_ids):
                s = c.start + j
                ids[i], pos[i], block[i], offset[i], lengths[i] = token, s, blocks[s // block_size], \
                    s % block_size, s + 1
                tables[i, :len(blocks)] = blocks  # entries past the context are never read
                i += 1
        n = i
        ids[n:], pos[n:], block[n:], offset[n:], lengths[n:] = 0, 0, self.scratch, 0, 1
        tables[n:, 0] = self.scratch

    def to_device(self) -> None:
        self.device_buf.copy_(self.host, non_blocking=True)
        if self.copied is not None:
            self.copied.record()


class GraphedDecode(DecodeStep):
    """The decode step as one CUDA graph per bucket (capture=False: the same buffers run
    eagerly, as on the CPU in the tests)."""

    kind = "CUDA graphs"

    def __init__(self, model, cache, *, max_num_seqs: int, max_model_len: int, block_size: int,
                 scratch_block: int, rank: int = 0, capture: bool | None = None):
        super().__init__(model, cache, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         block_size=block_size, scratch_block=scratch_block, rank=rank, smallest=1)
        self.capture = self.device.type == "cuda" if capture is None else capture
        self._inputs: dict[int, Packed] = {}
        self._graphs: dict[int, tuple] = {}  # bucket -> (graph or None, output buffer)
        self.error: str | None = None  # why capture failed, if it did (every bucket then runs eagerly)

    def _forward(self, inp: Packed) -> torch.Tensor:
        # MoE layers' fixed-shape exchange: no host read of a device value; a padding row writes
        # the scratch block, so the others are the real rows (the MoE load counters skip padding)
        with self.model.static_exchange(real=inp.block != self.scratch):
            return self.run_model(inp.ids if inp.x is None else inp.x, inp.positions, inp.block, inp.offset,
                                  inp.tables, inp.lengths)

    def _capture_all(self) -> None:
        for size in self.buckets:
            self._inputs[size] = Packed(size, self.max_blocks, self.scratch, self.hidden, self.dtype, self.device)
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

    def takes(self, mb) -> bool:
        """A decode micro-batch, or a speculative verify step of decoding sequences (a row per
        position: MicroBatch.decode_rows), of at most the largest bucket's rows."""
        return bool(mb.chunks) and mb.decode_rows and not mb.tree and mb.tokens <= self.buckets[-1]

    def __call__(self, x: torch.Tensor | None, mb) -> torch.Tensor:
        """x: None on the first stage (the ids come from the chunks), else [n, hidden]
        received activations -> [n, ...] rows, a row a new token."""
        if not self._graphs:
            self._capture_all()
        n = mb.tokens
        size = self.bucket(max(n, mb.step_rows or 0))  # MoE with DP: the bucket every replica agreed
        inp = self._inputs[size]
        inp.fill_host(mb.chunks, self.block_size)
        inp.to_device()
        if inp.x is not None:
            inp.x[:n] = x
        graph, out = self._graphs[size]
        if graph is None:
            out = self._forward(inp)
        else:
            graph.replay()
        # the next replay rewrites the output buffer: a stage that sends it on sends a copy
        return out[:n] if self.last_stage else out[:n].clone()

    @torch.inference_mode()  # the buffers were made in the runner's inference mode
    def replay_seconds(self, size: int, reps: int = 20) -> float | None:
        """Seconds one replay of bucket `size`'s graph takes on the device, all rows padding,
        or None without graphs: the GPU's share of a decode step. Not under TP or PP (a
        replay there joins collectives that the other ranks would have to join too)."""
        graph = self._graphs.get(size, (None, None))[0]
        if graph is None:
            return None
        inp = self._inputs[size]
        inp.fill_host([], self.block_size)
        inp.to_device()
        graph.replay()
        torch.cuda.synchronize(self.device)
        t0 = time.perf_counter()
        for _ in range(reps):
            graph.replay()
        torch.cuda.synchronize(self.device)
        return (time.perf_counter() - t0) / reps
