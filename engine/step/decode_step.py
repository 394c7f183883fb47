"""The decode step: what the runner calls for a decode micro-batch when it does not run the
model eagerly, whichever backend runs it (engine.step.compiled: inductor on the CPU;
engine.step.graphs: CUDA graphs). engine.step.policy picks the backend and whether to build one.

Buckets. A decode micro-batch of n sequences runs at the smallest sequence bucket >= n of
`seq_buckets`: 1 (or the backend's smallest), 2, 4, 8, ... and max_num_seqs. Padding rows
write their key and value into a scratch block that the schedulers never hand out (the
cache's last block), attend to it alone, and their outputs are dropped. Block tables are
max_model_len / block_size wide at most (`max_blocks`); a backend may run narrower ones.

The model runs on static inputs (layers.attention.StaticDecode): tensors only, no `.item()`,
`.tolist()` or host list inside, no shape that depends on the data. Layers with per-step
state are told a static step begins through their public methods (RotaryEmbedding.new_step;
the CUDA-graph backend also asks SparseMoE.static_exchange for the fixed-shape MoE exchange);
no process-wide torch setting is changed by building or running a step.
"""

from __future__ import annotations

import torch

from atoll.config.sampling import SamplingParams
from atoll.engine.batch.request import Request
from atoll.engine.batch.scheduler import Scheduled, Sequence
from atoll.engine.batch.shape import seq_buckets
from atoll.engine.sample.micro_batch import MicroBatch
from atoll.layers.attention import StaticDecode
from atoll.layers.rotary import RotaryEmbedding


class DecodeStep:
    """The runner's decode step for micro-batches `takes` accepts; `__call__(x, mb)` returns
    what model(x, mb.meta, cache) returns for them. Subclasses hold the bucket buffers and run
    `run_model` on them."""

    kind = "eager"  # the backend's name in messages
    freezing = False  # whether the weights were packed for the backend (a second copy)
    warm_rows = (1,)  # the padding rows warm_up runs, one run each (a backend with graphs per row count: more)

    def __init__(self, model, cache, *, max_num_seqs: int, max_model_len: int, block_size: int,
                 scratch_block: int, rank: int = 0, smallest: int = 1):
        self.model, self.cache = model, cache
        self.block_size, self.scratch = block_size, scratch_block
        self.max_blocks = -(-max_model_len // block_size)
        self.buckets = seq_buckets(max_num_seqs, smallest=smallest)
        p = next(model.parameters())
        self.dtype, self.device = p.dtype, p.device
        self.first_stage, self.last_stage = model.ctx.is_first_stage, model.ctx.is_last_stage
        self.hidden = None if self.first_stage else model.config.hidden_size  # received activations' width
        self.rank = rank
        self.compiles: list[tuple[int, float]] = []  # (bucket or buckets, seconds) of each compile/capture
        self.step_s: list[float] = []  # seconds of the steps run after the first, for the policy's record
        self.warm = False  # whether the first compile came from a disk cache
        self._rotaries = [m for m in model.modules() if isinstance(m, RotaryEmbedding)]
        self._used: set[int] = set()

    def takes(self, mb) -> bool:
        return bool(mb.chunks) and mb.is_decode and len(mb.chunks) <= self.buckets[-1]

    def bucket(self, n: int) -> int:
        """The sequence bucket n rows run at."""
        size = next(b for b in self.buckets if b >= n)
        self._used.add(size)
        return size

    def run_model(self, x: torch.Tensor, positions, block, offset, tables, lengths) -> torch.Tensor:
        """The model on one bucket's static inputs: x [seqs] ids or [seqs, hidden] activations."""
        for r in self._rotaries:  # the positions tensor is the same each step, its values are not
            r.new_step()
        meta = StaticDecode(positions, (block, offset), tables, lengths, self.block_size)
        return self.model(x, meta, self.cache)

    @torch.inference_mode()  # as the runner's tick: the graph's guards include it
    def warm_up(self) -> None:
        """Run the step once on one padding row (positions in the scratch block), and on more
        where the backend has a graph per row count (warm_rows), so that a living engine
        compiles or captures its graphs before it says it is ready, not on its first request. Every rank of a TP group calls it together (its collectives)."""
        for rows in self.warm_rows:
            seqs = [Sequence(Request(-1, [0], SamplingParams(max_tokens=2)), None, output=[0], blocks=[self.scratch],
                             cached=1) for _ in range(rows)]
            mb = MicroBatch.of([Scheduled(seq, 1, 1) for seq in seqs], self.block_size, device=self.device)
            x = None if self.first_stage else torch.zeros(rows, self.hidden, dtype=self.dtype, device=self.device)
            self(x, mb)

    @property
    def buckets_run(self) -> list[int]:
        return sorted(self._used)

    def summary(self) -> dict:
        """What the step did, for the policy's record (engine.step.policy)."""
        steps = sorted(self.step_s)
        return {"compile_s": [round(s, 3) for _, s in self.compiles], "warm": self.warm,
                "step_s": steps[len(steps) // 2] if steps else None, "steps": len(steps)}
