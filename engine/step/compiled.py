"""The decode step on the CPU: a decode micro-batch padded to a bucket (engine.step.decode_step) and
run through `torch.compile`d code (inductor) that sees tensors only.

Buckets 2, 4, 8, ... and max_num_seqs (MIN_ROWS below says why not 1), or 1 when max_num_seqs
is 1; block tables padded to a power-of-two number of blocks (at least 2, at most
max_model_len / block_size). The step reads per-bucket input buffers (token ids or received
activations, positions, cache slots, context lengths) and a block table, filled by device
copies from the micro-batch's metadata.

Graphs: one per decoder layer kind, compiled on first use, which every layer of the stage
runs (its weights and cache are the graph's inputs, not constants), and on the last stage one
for the LM head (the largest product of a step: eagerly it would run F.linear, or int8's
bf16 kernel, 2.2 ms against 1.25 ms as a compiled row reduction at one row); the embedding and
the final norm stay eager. Inductor's time grows with the code it generates, so one layer's
graph compiles far sooner than the whole stack's: SmolLM2-135M's 30 layers compiled cold in
28.9 s this way against 185.0 s as one graph of the stage, one run after the other on a 2-core
machine at load 4, with the same tokens and the same step time (187.6 against 187.3 ms at 16
rows). The first layer runs the same graph: it starts the residual stream from zeros (0 + x is
x exactly), and the step's cos and sin are made before the layers. The sequence count and the block-table width are symbolic (`mark_dynamic`, also on the
activations between layers), so the graphs serve every bucket and context length without
recompiling. A stage whose layers are not all Llama-style decoder layers is one graph.
With max_num_seqs 1 (a latency run, as `atoll bench --batch 1` configures it) the one graph is
static at one row and every linear is a row reduction (layers.packed.row_product), which
inductor turns into one vectorised pass over the weight: SmolLM2's 121 linears took 15-23 ms
that way against 26-29 ms through oneDNN at two rows, side by side on a 2-core AMD EPYC. It
stays out of the shared graph: a run whose batch drains to one sequence would stall compiling a
second graph for its last tokens. In that graph a product's input (a norm's output, silu(gate)
* up) is written once to a buffer (ONE_ROW_OPTIONS): by default inductor recomputes it inside
the loop over the weight's rows, once per row, which made int8's row reductions compute-bound
(the int8 step went from 19-20 ms to 15.5 ms a token on SmolLM2, float32's stayed as it was).
Rank 0 prints a line on stderr whenever the step compiles.

Collectives. TP's all_reduce / all_gather (comm.Group -> torch.distributed) are traced:
dynamo turns them into functional collectives, which inductor calls in place in the graph,
over gloo on CPU. PP's send/recv stay outside: the runner receives into the bucket's buffer.

Weights (EngineConfig.compile_freezing, on by default): every linear weight is packed once
for oneDNN at build (layers.packed.pack_onednn; on this AMD EPYC oneDNN's float32 GEMM streams
SmolLM2's weights 1.5-2x faster than MKL's F.linear at 1-16 rows) and the graph calls the
packed product as an operator taking the weight and its layer's packed copy as inputs (the
copy as an opaque object, layers.packed.OnednnWeight: dynamo takes no mkldnn tensor, but a
registered opaque object is a graph input like a tensor, so every layer runs the one graph with
its own copy). This is what inductor's freezing did, but done outside the graph: freezing made
the packed weights constants of the graph, which inductor's FX graph cache cannot store, so
every run compiled again; here the graph holds no constants and is cached on disk, and the
packing (a fraction of a second) is redone at each load. The copy costs a second copy of the
weights, so it is made only when a copy on every rank of the machine fits in a quarter of its
available memory.

Cache: `spec.engine.cache_path / "inductor" / RANGE_DIR` (ATOLL_CACHE or ~/.cache/atoll), unless the user
set TORCHINDUCTOR_CACHE_DIR, which then wins. torch reads that variable at each compile; the
step sets it only for the duration of its own calls and puts back what was there, so building
or running a step leaves the process's environment and torch's settings as they were.
"""

from __future__ import annotations

import os
import sys
import time
from contextlib import nullcontext
from functools import partial

import torch

from atoll.engine.batch.shape import block_bucket
from atoll.engine.step.decode_step import DecodeStep
from atoll.layers import packed

# one sequence runs padded to two: dynamo would specialise a dimension of size 1 (a second
# graph); at two rows it shares the symbolic one
MIN_ROWS = 2
# The symbolic dimensions' upper bounds, the same for every engine: inductor's on-disk cache keys a
# graph without the range it was marked with, and a graph cached for rows <= 32 (max_num_seqs 8
# with drafts of 3) then fails its guards in an engine marking rows <= 128 (ConstraintViolation)
# instead of compiling again; one range for all makes every cached graph valid for every engine.
MAX_ROWS = 1 << 16
MAX_BLOCKS = 1 << 20
# graphs cached under another range (atoll's older ranges, per engine) would fail these guards:
# the cache's folder is named by the range
RANGE_DIR = f"rows{MAX_ROWS}-blocks{MAX_BLOCKS}"
# the one-row graph: a product's input (a norm's output, silu(gate) * up) is computed once into
# a buffer, not again inside the loop over every weight row, where inductor would inline it
# (it does so for a broadcast input whose expression has up to 50 operations on the CPU)
ONE_ROW_OPTIONS = {"realize_opcount_threshold": 4}


def inductor_cache_dir(cache_path) -> str | None:
    """Where the step's graphs go: None when the user set TORCHINDUCTOR_CACHE_DIR (torch reads
    it), else `cache_path / "inductor" / RANGE_DIR`. Importing torch._inductor sets the variable to its
    default in /tmp: that one is not the user's. Without the variable torch._inductor is not
    imported here (1.8 s of a short eager job's start on 2 cores)."""
    theirs = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if theirs:
        from torch._inductor.runtime.cache_dir_utils import default_cache_dir

        if os.path.abspath(theirs) != os.path.abspath(default_cache_dir()):
            return None
    return str(cache_path / "inductor" / RANGE_DIR)


def _cache_dir_for(cache_dir: str | None, first: bool):
    """Inductor's cache at `cache_dir` for a bucket's first call, the one that compiles its
    graphs (torch's own scoped setting, cache_dir_utils.temporary_cache_dir); nothing when
    cache_dir is None (the user's TORCHINDUCTOR_CACHE_DIR holds) or the graphs exist."""
    if cache_dir is None or not first:
        return nullcontext()
    from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

    return temporary_cache_dir(cache_dir)


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


class CompiledDecode(DecodeStep):
    """The decode step as one inductor graph per stage."""

    kind = "inductor"

    def __init__(self, model, cache, *, max_num_seqs: int, max_model_len: int, block_size: int,
                 scratch_block: int, rank: int = 0, freezing: bool = True, cache_dir: str | None = None,
                 one_row: bool | None = None):
        # one_row (default: max_num_seqs 1, a latency run): a one-sequence step runs a static one-row
        # graph of row reductions; rows beyond it (max_num_seqs > 1: speculative verify rows) the
        # shared symbolic graph. Otherwise every step the shared graph, one sequence padded to two.
        one_row = max_num_seqs == 1 if one_row is None else one_row
        super().__init__(model, cache, max_num_seqs=max_num_seqs, max_model_len=max_model_len,
                         block_size=block_size, scratch_block=scratch_block, rank=rank,
                         smallest=1 if one_row else MIN_ROWS)
        self.cache_dir = cache_dir  # None: torch's own choice (the user's TORCHINDUCTOR_CACHE_DIR)
        self.freezing = freezing and self.buckets[-1] > 1 and _pack(model)  # the one-row graph packs nothing
        self._inputs: dict[int, Bucket] = {}
        self._announced = False
        # static but for the dimensions marked dynamic; no graph break allowed. One graph per
        # decoder layer kind, which every layer of the stage runs (see the module's docstring)
        self._layers = model.step_layers() or None
        if self._layers:
            shared = self.buckets[-1] > 1  # a graph of symbolic rows for the buckets past one row
            kinds = {type(layer) for layer in self._layers}
            # {rows: {layer kind: graph}}: 1 the one-row graph, None the shared symbolic one
            self._layer_graphs = {}
            if one_row and shared:
                self.warm_rows = (1, MIN_ROWS)  # both graphs made before a living engine says it is ready
            if one_row:
                self._layer_graphs[1] = {kind: torch.compile(kind.forward, dynamic=False, fullgraph=True,
                                                             options=ONE_ROW_OPTIONS) for kind in kinds}
            if shared:
                self._layer_graphs[None] = {kind: torch.compile(kind.forward, dynamic=False, fullgraph=True)
                                            for kind in kinds}
            self._forwards = [partial(self._through_graph, layer) for layer in self._layers]  # made once
            last = getattr(getattr(model, "ctx", None), "is_last_stage", False)
            self._head = getattr(model, "lm_head", None) if last else None
            if self._head is not None:  # the LM head, the largest product of a step, in a graph of its own
                self._head_graphs = {rows: torch.compile(type(self._head).forward, dynamic=False, fullgraph=True)
                                     for rows in self._layer_graphs}
            self._step = self._run_layers
        else:
            self._step = torch.compile(self.run_model, dynamic=False, fullgraph=True)

    def _graphs(self, x) -> int | None:
        """The key of self._layer_graphs and self._head_graphs that x's rows run: 1 the static
        one-row graph, None the shared one, whose rows are symbolic."""
        return 1 if len(x) == 1 and 1 in self._layer_graphs else None

    def _through_graph(self, layer, x, residual, meta, *rest):
        """One decoder layer through its kind's graph. The first layer runs as the others: its
        residual stream starts from zeros (0 + x is x exactly), and this step's cos and sin are
        made before the graph."""
        residual = torch.zeros_like(x) if residual is None else residual
        cos_sin = layer.self_attn.rotary.prime(meta.positions, self.dtype)
        key = self._graphs(x)
        if key is None:  # tensors made outside the graphs: the same symbolic rows
            for t in (x, residual, *cos_sin):
                torch._dynamo.mark_dynamic(t, 0, min=MIN_ROWS, max=MAX_ROWS)
        return self._layer_graphs[key][type(layer)](layer, x, residual, meta, *rest)

    def _through_head(self, x):
        """The LM head through its graph: at one row the weight's row reduction (int8's too),
        at more the packed product, inside the graph where eager would run F.linear."""
        key = self._graphs(x)
        if key is None:
            torch._dynamo.mark_dynamic(x, 0, min=MIN_ROWS, max=MAX_ROWS)
        return self._head_graphs[key](self._head, x)

    def _run_layers(self, *inputs) -> torch.Tensor:
        """run_model with each decoder layer's forward through its kind's compiled graph, and
        the LM head's through its own (only for this call: eager steps use the same modules);
        the embedding and the final norm run as they do eagerly."""
        for layer, forward in zip(self._layers, self._forwards):
            layer.forward = forward
        if self._head is not None:
            self._head.forward = self._through_head
        try:
            return self.run_model(*inputs)
        finally:
            for layer in self._layers:
                del layer.forward
            if self._head is not None:
                del self._head.forward

    def takes(self, mb) -> bool:
        """A decode micro-batch, or a speculative verify step of decoding sequences (one row per
        position: MicroBatch.decode_rows), of at most the largest bucket's rows, unless its
        contexts differ so much that the eager step's attention, grouped by context
        (layers.attention.decode_groups), reads far fewer keys than the graph's, which reads
        every row's up to the longest."""
        return (bool(mb.chunks) and mb.decode_rows and not mb.tree and mb.tokens <= self.buckets[-1]
                and len(mb.meta.decode_groups(None)) == 1)

    def __call__(self, x: torch.Tensor, mb) -> torch.Tensor:
        """x: [n] token ids (first stage) or [n, hidden] activations -> [n, ...] rows, a row a
        token (a verify step's pending token and drafts are rows of their own)."""
        meta, n = mb.meta, mb.tokens
        size = self.bucket(n)
        inp = self._inputs.get(size)
        first = inp is None  # a bucket's first call compiles its graphs
        if first:
            inp = self._inputs[size] = Bucket(size, self.scratch, self.hidden, self.dtype, self.device)
        blocks = -(-(max(meta.start_list) + 1) // self.block_size)  # host list: no sync
        width = block_bucket(blocks, self.max_blocks)
        inp.fill(n, mb.ids if x is None else x, meta)
        # contiguous at every width (a view of a wider buffer would guard on its stride)
        tables = torch.full((size, width), self.scratch, dtype=torch.long, device=self.device)
        tables[:n, :blocks] = meta.block_tables[:, :blocks]
        if self.max_blocks > 2:  # one graph for every width 2..max_blocks
            torch._dynamo.mark_dynamic(tables, 1, min=2, max=MAX_BLOCKS)
        if size > 1:  # one graph for every bucket (the one-row graph is static)
            for t in (inp.x, inp.positions, inp.block, inp.offset, inp.lengths, tables):
                torch._dynamo.mark_dynamic(t, 0, min=MIN_ROWS, max=MAX_ROWS)
        if not self._announced and self.rank == 0:
            self._announced = True  # the first call compiles: say why the run pauses here
            print("atoll: compiling the decode step (--enforce-eager or --compile never skips it)",
                  file=sys.stderr, flush=True)
        graphs, hits, t0 = _graph_count(), _cache_hits(), time.perf_counter()
        with _cache_dir_for(self.cache_dir, first):
            out = self._step(inp.x, inp.positions, inp.block, inp.offset, tables, inp.lengths)
        seconds = time.perf_counter() - t0
        if _graph_count() != graphs:  # this call compiled
            self.compiles.append((size, seconds))
            self.warm = _cache_hits() > hits  # inductor's disk cache held the graph
            self._report()
        else:
            self.step_s.append(seconds)
        return out[:n]

    def _report(self) -> None:
        if self.rank != 0:
            return
        size, seconds = self.compiles[-1]
        how = "weights packed for oneDNN" if self.freezing else "F.linear"
        how += ", from inductor's cache" if self.warm else ""
        where = self.cache_dir or os.environ.get("TORCHINDUCTOR_CACHE_DIR", "torch's default")
        again = f" (compile {len(self.compiles)}: a recompile)" if len(self.compiles) > 1 else ""
        graphs = (f"one graph a decoder layer kind ({len(self._layers)} layers share "
                  f"{'it' if len(next(iter(self._layer_graphs.values()))) == 1 else 'them'})"
                  if self._layers else "one graph")
        print(f"atoll: compiled the decode step in {seconds:.1f} s{again}, inductor, {how}, cached in {where}: "
              f"{graphs} for buckets of {', '.join(map(str, self.buckets))} sequences x up to {self.max_blocks} "
              f"blocks (first run at {size})", file=sys.stderr, flush=True)


def _pack(model) -> bool:
    """Packs the model's linear layers' weights for oneDNN (layers.packed: each layer holds its
    copy); whether any was packed."""
    return packed.pack_onednn(model.linear_layers()) > 0


def _cache_hits() -> int:
    from torch._dynamo.utils import counters

    return counters["inductor"]["fxgraph_cache_hit"]


def _graph_count() -> int:
    """Graphs dynamo has compiled in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"]
