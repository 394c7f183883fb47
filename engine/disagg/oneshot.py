"""Disaggregated prefill and decode as one job: ranks 0 .. P-1 are the prefill engine, ranks
P .. P+D-1 the decode engine, each with its own layout (parallel.parts).

The prefill engine runs each routed request's prompt with max_tokens 1: continuous batching
over its queue, so requests wait there while its ranks are busy. As a prompt's first token
is sampled, the prefill rank that sampled it writes a header (request index, first token,
prompt length, TTFT) for the decode replica that serves the request to the job's store, and
every prefill rank sends its share of the prompt's KV (engine.disagg.transfer) before the blocks
are freed. The decode engine
checks for a header once per step (one all_reduce over its ranks, so they take it at the
same step), gives the sequence blocks when its lane has room, receives the KV into them and
decodes on from the first token, as if it had computed the prompt itself.

Conditional disaggregation (`route`): a prompt shorter than `disagg_min_prompt_tokens`, or
whose part not already cached on its decode replica is, is prefilled by the decode engine.
The decision is made once, before the ranks start, from the prompts in order: a prompt's
cached part is the run of full blocks an earlier prompt of the same replica shared with it.

With random sampling the header carries the request's generator state after the first
token, so a seeded request draws the same stream as in a colocated run.

Limits: the prefill engine is one replica (dp 1); GQA attention only (not MLA's latent
cache); the local launcher only.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from atoll.comm.group import Group
from atoll.engine.disagg import transfer as kv_transfer
from atoll.engine.disagg.decision import route
from atoll.engine.rank.generate import Request, run_requests
from atoll.engine.rank.run_spec import RunSpec
from atoll.engine.rank.runner import ModelRunner
from atoll.engine.sample.sampler import SamplerState
from atoll.engine.batch.scheduler import Sequence
from atoll.errors import AtollError, RankFailure
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ContextOptions
from atoll.parallel.parts import bases, create_part, engine_of


@dataclass(frozen=True)
class Job:
    """What every rank of a disaggregated job gets; picklable."""
    prefill: RunSpec
    decode: RunSpec
    remote: tuple  # Requests the prefill engine computes (their own max_tokens; forced to 1 there)
    local: tuple  # Requests the decode engine prefills itself
    replica: dict  # request index -> decode replica
    options: ContextOptions | None = None

    @property
    def layouts(self) -> list[Layout]:
        return [Layout.parse(self.prefill.layout), Layout.parse(self.decode.layout)]


def disagg_worker(rank: int, world_size: int, job: Job, device: str = "cpu"):
    """Every rank of the job: build its engine's part, run it. Returns a dict: results
    (index -> result) on each decode replica's first rank, adopted (indices whose KV came
    from the prefill engine), sent (index -> KV bytes this prefill rank sent)."""
    layouts = job.layouts
    engine, ctx = create_part(layouts, rank, device, job.options)
    world = Group(dist.group.WORLD, range(world_size), rank, "job", device)
    runner = ModelRunner(job.decode if engine else job.prefill, ctx)
    base = bases(layouts)
    if engine == 0:
        return {"sent": _prefill(runner, world, job, base[1])}
    return _decode(runner, world, job, base[0])


def _prefill(runner, world, job: Job, decode_base: int) -> dict[int, int]:
    ctx, (src, dst) = runner.ctx, job.layouts
    messages = {d: kv_transfer.plan(runner.config, src, dst, d) for d in range(dst.dp)}
    sent: dict[int, int] = {}
    handed = [0] * dst.dp  # headers written per decode replica
    # the sampling rank writes the headers: its generator drew the first token
    store = _store() if ctx.rank == runner.sampler_rank else None

    def on_token(seq, started):
        index, tokens = seq.request.index, len(seq.request.prompt_token_ids)
        d = job.replica[index]
        if store is not None:
            key, generator = _key(d, handed[d]), seq.state.generator
            if generator is not None:  # the stream goes on where the first token left it
                store.set(key + "/rng", generator.get_state().numpy().tobytes())
            ttft_us = int((seq.first_token_at - started) * 1e6)
            store.set(key, f"{index},{seq.output[0]},{tokens},{ttft_us}")  # last: the decode ranks wait for it
        handed[d] += 1
        sent[index] = kv_transfer.send(runner, messages[d], ctx.rank, seq.blocks, tokens, world, decode_base)

    mine = [Request(r.index, r.prompt_token_ids, replace(r.params, max_tokens=1)) for r in job.remote]
    run_requests(runner, mine, on_token=on_token)
    return sent


def _store():
    """The job's rendezvous store: headers go through it, so the decode ranks can check for
    one without blocking (a gloo irecv reports completion only once waited on)."""
    return _get_default_store()


def _key(replica: int, k: int) -> str:
    return f"atoll/disagg/{replica}/{k}"


class Inbox:
    """The decode side of the handoff (run_requests' `inbox`): the k-th header for this
    replica, taken by every rank of the replica at the same step."""

    def __init__(self, runner, world, job: Job, prefill_base: int):
        self.runner, self.world, self.job, self.base = runner, world, job, prefill_base
        ctx = runner.ctx
        self.replica = ctx.coords.dp
        self.requests = {r.index: r for r in job.remote}
        self.expect = sum(job.replica[r.index] == self.replica for r in job.remote)
        self.messages = kv_transfer.plan(runner.config, job.layouts[0], ctx.layout, self.replica)
        self.adopted: list[int] = []
        self.store = _store() if job.remote else None

    @property
    def pending(self) -> bool:
        return len(self.adopted) < self.expect

    def poll(self, tick: int, lanes) -> list[tuple[Sequence, float]]:
        if not self.job.remote:
            return []
        runner, ctx = self.runner, self.runner.ctx
        key = _key(self.replica, len(self.adopted))
        flags = torch.ones(ctx.layout.dp, dtype=torch.long, device=runner.device)
        flags[self.replica] = int(self.pending and self.store.check([key]))
        if not int(ctx.world.all_reduce(flags, op="min")[self.replica]):
            if not lanes.has_work():
                time.sleep(0.002)  # idle until the next header: leave the cores to the prefill ranks
            return []  # some rank of the replica has not seen it yet
        index, first, tokens, ttft_us = (int(x) for x in self.store.get(key).decode().split(","))
        req = self.requests[index]
        state = SamplerState(req.params, runner.device)
        if state.generator is not None:
            raw = self.store.get(key + "/rng")
            state.generator.set_state(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        seq = Sequence(req, state, output=[first], arrived_step=tick)
        if not lanes.adopt(seq, tick):
            return []  # no room in the lane yet; the prefill ranks wait on the send
        kv_transfer.receive(runner, self.messages, ctx.rank, seq.blocks, tokens, self.world, self.base)
        now = time.perf_counter()
        seq.first_token_at = now
        self.adopted.append(index)
        return [(seq, now - ttft_us / 1e6)]


def _decode(runner, world, job: Job, prefill_base: int) -> dict:
    ctx = runner.ctx
    inbox = Inbox(runner, world, job, prefill_base)
    mine = [r for r in job.local if job.replica[r.index] == ctx.coords.dp]
    results = run_requests(runner, mine, inbox=inbox)
    leader = ctx.coords.tp == 0 and ctx.is_first_stage
    return {"results": results if leader else {}, "adopted": inbox.adopted if leader else []}


class EngineFailure(RankFailure):
    """A rank of one engine of a disaggregated job failed: names the engine and its rank there."""

    def __init__(self, engine: str, local_rank: int, failure: RankFailure):
        """engine: its label, "prefill engine" or "decode engine 1"."""
        where = f"{engine} rank {local_rank} (job rank {failure.rank}" + \
            (f" on {failure.node})" if failure.node else ")")
        AtollError.__init__(self, f"{where} failed: {failure.cause}")
        self.engine, self.rank, self.cause, self.node = engine, failure.rank, failure.cause, failure.node


def generate_disagg(llm, requests: list[Request], *, timeout_s: float | None = None) -> list[dict]:
    """Run `requests` (LLM.prepare's) on llm.prefill_layout + llm.layout under llm's
    launcher; one result per request, in order, each with metrics prefilled_on ("prefill" or
    "decode") and kv_bytes_sent."""
    o, prefill, decode = llm.options, llm.prefill_layout, llm.layout
    remote, local, replica = route(requests, min_tokens=o.disagg_min_prompt_tokens, block_size=o.block_size,
                                   prefix_caching=o.enable_prefix_caching, dp=decode.dp)
    first = [replace(r, params=replace(r.params, max_tokens=1)) for r in remote]
    seqs = min(o.max_num_seqs, max(1, -(-len(remote) // prefill.pp)))
    # the prefill engine never decodes: no compiled decode step or CUDA graphs to build there
    job = Job(prefill=replace(llm.spec(first or None).with_engine(enforce_eager=True), layout=str(prefill),
                              cache_seqs=seqs),
              decode=llm.spec(requests), remote=tuple(remote), local=tuple(local), replica=replica,
              options=llm.context_options())
    try:
        values = llm.run(disagg_worker, prefill.world_size + decode.world_size, job, timeout_s=timeout_s)
    except RankFailure as e:
        engine, local_rank = engine_of([prefill, decode], e.rank)
        raise EngineFailure(("prefill engine", "decode engine")[engine], local_rank, e) from e
    results, adopted, sent = {}, set(), {}
    for v in values:
        results.update(v.get("results", {}))
        adopted.update(v.get("adopted", ()))
        for index, n in v.get("sent", {}).items():
            sent[index] = sent.get(index, 0) + n
    out = []
    for r in requests:
        res = results[r.index]
        res["metrics"] |= {"prefilled_on": "prefill" if r.index in adopted else "decode",
                           "kv_bytes_sent": sent.get(r.index, 0)}
        out.append(res)
    return out
