"""Perplexity of a text through atoll's own ranks and paged KV cache (`atoll eval perplexity`).

The text's tokens are cut into windows of `window` tokens (the last, shorter one dropped); each
window is scored on its own, from an empty cache. The engine returns no prompt logprobs, so a
rank function (score_worker, run on every rank through LLM.run) builds the ranks' ModelRunner
as engine/worker.py does and feeds every window one token per step, all windows side by side as
one decode batch (max_num_seqs windows at a time): position t's logits come from a decode step whose attention reads positions
0..t from the paged cache, so every prediction sees the cache as stored (quantized under
--kv-cache-dtype: a prefill's own step would attend to its new keys before they are stored).
The NLL of token t + 1 is -log_softmax(logits_t)[token t + 1] in float64; perplexity is
exp(mean NLL) over every scored token of every window.

Layouts: TP and PP (stages hand activations on with send/recv, one step at a time); dp must be 1.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import math

import torch

from atoll.engine.rank.runner import ModelRunner
from atoll.errors import InputError
from atoll.kernels import backend
from atoll.layers.attention import AttentionMetadata
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext

DEFAULT_TEXT = "torch's README (the long description in torch's installed METADATA)"


def default_text() -> str:
    """The default text: torch's README, as its installed package metadata carries it (every
    atoll install has torch); it changes with torch's version, so figures name the version."""
    meta = importlib.metadata.distribution("torch").read_text("METADATA") or ""
    return meta.split("\n\n", 1)[1] if "\n\n" in meta else meta


def windows(ids: list[int], window: int, max_tokens: int | None = None) -> list[list[int]]:
    """Consecutive windows of `window` tokens from ids (at most max_tokens tokens in all)."""
    if window < 2:
        raise InputError(f"window={window} must be at least 2 tokens")
    if max_tokens is not None:
        ids = ids[:max_tokens]
    out = [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]
    if not out:
        raise InputError(f"the text has {len(ids)} tokens, fewer than one window of {window}")
    return out


@dataclasses.dataclass
class Scores:
    """Per window, per scored position t (predicting token t + 1): its NLL and the model's top-1 token."""

    nll: list[list[float]]
    top1: list[list[int]]

    @property
    def tokens(self) -> int:
        return sum(len(n) for n in self.nll)

    @property
    def perplexity(self) -> float:
        return math.exp(sum(map(sum, self.nll)) / self.tokens)


def score_worker(rank: int, world_size: int, spec, wins: list[list[int]], parallel=None, device: str = "cpu",
                 node: str | None = None, ranks_here: int | None = None) -> Scores | None:
    """On every rank: this rank's stage scores the windows; the last stage's tp rank 0 returns the Scores."""
    layout = Layout.parse(spec.layout)
    ctx = ParallelContext.create(layout, rank, device, parallel, node=node) if world_size > 1 \
        else ParallelContext.single(device, parallel)
    with backend.using(spec.engine.kernels):  # the run's kernel path, for this call only
        runner = ModelRunner(spec, ctx, ranks_here=ranks_here)
        return score(runner, wins)


def score(runner, wins: list[list[int]]) -> Scores | None:
    """Every window through `runner`'s stage, max_num_seqs at a time (see the module docstring)."""
    batch = runner.spec.engine.max_num_seqs
    parts = [_score(runner, wins[i:i + batch]) for i in range(0, len(wins), batch)]
    if parts[0] is None:
        return None
    return Scores([x for p in parts for x in p.nll], [x for p in parts for x in p.top1])


@torch.inference_mode()
def _score(runner, wins: list[list[int]]) -> Scores | None:
    """Windows side by side as one decode batch, one step per position; blocks 0.. reused per call."""
    ctx, bs = runner.ctx, runner.spec.engine.block_size
    n, length = len(wins), len(wins[0])
    per = -(-length // bs)
    tables = [[i * per + j for j in range(per)] for i in range(n)]
    ids = torch.tensor(wins, dtype=torch.long, device=runner.device)  # [windows, window]
    holder = ctx.is_last_stage and ctx.coords.tp == 0
    nll, top1 = [[] for _ in wins], [[] for _ in wins]
    for t in range(length - 1):
        meta = AttentionMetadata.build(tables, [t] * n, [1] * n, bs, device=runner.device)
        if ctx.is_first_stage:
            x = ids[:, t]
        else:
            x = ctx.pp.recv((n, runner.config.hidden_size), runner.dtype, src=ctx.pp.rank - 1, device=runner.device)
        out = runner.model(x, meta, runner.cache)  # [windows, vocab] on the last stage, else hidden
        if not ctx.is_last_stage:
            ctx.pp.send(out, dst=ctx.pp.rank + 1)
        elif holder:
            logp = torch.log_softmax(out.double(), dim=-1)
            step = (-logp.gather(1, ids[:, t + 1:t + 2])[:, 0]).tolist()
            best = out.argmax(dim=-1).tolist()
            for i in range(n):
                nll[i].append(step[i])
                top1[i].append(best[i])
    return Scores(nll, top1) if holder else None


def run_scores(llm, wins: list[list[int]], *, timeout_s: float | None = None) -> Scores:
    """The windows scored on `llm`'s ranks (its layout and engine options; dp must be 1)."""
    layout = llm.layout
    if layout.dp != 1:
        raise InputError(f"perplexity runs one replica: use a layout without DP (got {layout})")
    length = len(wins[0])
    if length > llm.max_model_len:
        raise InputError(f"--window {length} exceeds the model's context of {llm.max_model_len} tokens")
    bs = llm.options.block_size
    spec = dataclasses.replace(llm.spec(), max_model_len=length)
    # its own tables, one list per window for every layer (no sliding layers' cache: engine.kv.windowed)
    spec = spec.with_engine(num_blocks=min(len(wins), llm.max_num_seqs) * -(-length // bs), enforce_eager=True,
                            disable_hybrid_kv_cache_manager=True)
    values = llm.run(score_worker, layout.world_size, spec, wins, parallel=llm.context_options(),
                     timeout_s=timeout_s)
    return next(v for v in values if v is not None)
