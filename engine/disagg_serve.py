"""The ranks of a living disaggregated engine: one job, ranks 0 .. P-1 the prefill engine and
P .. P+D-1 the decode engine (parallel.parts), each running its own ServeLoop over its own
ranks. The driver is engine/disagg_online.py.

Hand-off, per request routed to the prefill engine:
1. The driver adds it to the prefill engine with max_tokens 1, naming the decode replica.
2. As its first token is sampled, the prefill rank that sampled it puts a header on the
   driver's outbox (index, first token, prompt length, when it started and took its first
   token, and with random sampling the generator's state after that token), and every
   prefill rank sends its share of the prompt's KV to that decode replica
   (engine.kv_transfer); the send waits until the decode ranks receive it. Each prefill rank
   then reports the bytes it sent.
3. The driver passes the header to the decode engine's rank 0, which broadcasts it with the
   other commands: every decode rank takes the headers in the order they came. The replica
   the header names gives the sequence blocks (when its lane has room; with several replicas
   all decode ranks agree through one all_reduce whether it did) and receives the KV.
   Headers wait, in order, until there is room: the prefill ranks wait on the send meanwhile.
4. The decode engine decodes on from the first token as if it had computed the prompt.

The prefill engine's own results are not reported, except aborts: the decode engine reports
the request's end. The first token is reported by the prefill engine as it is sampled.

Headers travel through the driver, not the job's rendezvous store: nothing is left there.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from atoll.comm.group import Group
from atoll.engine import kv_transfer
from atoll.engine.runner import ModelRunner, RunSpec
from atoll.engine.sampling import SamplerState
from atoll.engine.scheduler import Sequence
from atoll.engine.serve_worker import ServeLoop
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ContextOptions
from atoll.parallel.parts import bases, create_part


@dataclass(frozen=True)
class LiveJob:
    """What every rank of a living disaggregated job gets; picklable."""
    prefill: RunSpec
    decode: RunSpec
    options: ContextOptions | None = None

    @property
    def layouts(self) -> list[Layout]:
        return [Layout.parse(self.prefill.layout), Layout.parse(self.decode.layout)]


@dataclass(frozen=True)
class Header:
    index: int
    first: int  # the first token, sampled by the prefill engine
    tokens: int  # prompt length: the positions whose KV comes over
    replica: int  # the decode replica
    started: float  # time.perf_counter() in the prefill engine when it took the request
    first_at: float  # ... when it sampled the first token (one machine: one clock)
    rng: bytes | None = None  # the generator's state after the first token


def disagg_serve_worker(rank: int, world_size: int, job: LiveJob, prefill_inbox, decode_inbox, outbox,
                        device: str = "cpu", node: str | None = None, ranks_here: int | None = None) -> None:
    layouts = job.layouts
    engine, ctx = create_part(layouts, rank, device, job.options)
    world = Group(dist.group.WORLD, range(world_size), rank, "job", device)
    base = bases(layouts)
    runner = ModelRunner(job.decode if engine else job.prefill, ctx, ranks_here=ranks_here)
    if engine == 0:
        loop = _prefill_loop(runner, world, prefill_inbox, outbox, layouts[1], base[1])
    else:
        loop = _decode_loop(runner, world, decode_inbox, outbox, layouts[0], base[0])
    loop.ready()
    loop.run()
    if loop.first:
        outbox.put(("stopped", engine))


def _prefill_loop(runner, world, inbox, outbox, decode: Layout, decode_base: int) -> ServeLoop:
    ctx = runner.ctx
    messages = {d: kv_transfer.plan(runner.config, ctx.layout, decode, d) for d in range(decode.dp)}
    replica: dict[int, int] = {}  # request index -> its decode replica

    def command(cmd) -> None:
        if cmd[0] == "route":  # ("route", index, decode replica), just before its add
            replica[cmd[1]] = cmd[2]

    def on_token(seq, started) -> None:
        index, tokens = seq.request.index, len(seq.request.prompt_token_ids)
        d = replica.pop(index)
        if ctx.rank == runner.sampler_rank:  # its generator drew the first token
            generator = seq.state.generator
            rng = generator.get_state().numpy().tobytes() if generator is not None else None
            outbox.put(("handoff", Header(index, seq.output[0], tokens, d, started, seq.first_token_at, rng)))
        sent = kv_transfer.send(runner, messages[d], ctx.rank, seq.blocks, tokens, world, decode_base)
        outbox.put(("sent", index, sent))

    def forward(index, result) -> bool:  # its decode engine reports the end, unless it never got there
        replica.pop(index, None)
        return result["finish_reason"] == "abort"

    return ServeLoop(runner, inbox, outbox, on_token=on_token, command=command, forward=forward, name="prefill")


class Handoffs:
    """The decode side: headers in the order they came, adopted in that order (EngineCore's
    inbox). Requests aborted before their KV came are still received, then ended."""

    def __init__(self, runner, world, prefill: Layout, prefill_base: int):
        self.runner, self.world, self.base = runner, world, prefill_base
        ctx = runner.ctx
        self.replica, self.replicas = ctx.coords.dp, ctx.layout.dp
        self.messages = {d: kv_transfer.plan(runner.config, prefill, ctx.layout, d) for d in range(ctx.layout.dp)}
        self.queue: deque = deque()  # (Header, Request)
        self.aborted: set[int] = set()
        self.core = None  # the EngineCore, set once built

    def command(self, cmd) -> None:
        if cmd[0] == "adopt":  # ("adopt", Header, Request)
            self.queue.append((cmd[1], cmd[2]))
        elif cmd[0] == "abort" and any(h.index == cmd[1] for h, _ in self.queue):
            self.aborted.add(cmd[1])

    @property
    def pending(self) -> bool:
        return bool(self.queue)

    def poll(self, tick: int, lanes) -> list[tuple[Sequence, float]]:
        self._end_aborted()
        out = []
        while self.queue:
            header, req = self.queue[0]
            mine = header.replica == self.replica
            state = SamplerState(req.params, self.runner.device)
            if state.generator is not None and header.rng is not None:
                state.generator.set_state(torch.frombuffer(bytearray(header.rng), dtype=torch.uint8))
            seq = Sequence(req, state, output=[header.first], arrived_step=tick)
            ok = lanes.adopt(seq, tick) if mine else True
            if self.replicas > 1:  # only the named replica decides; every decode rank follows it
                flag = torch.tensor([int(ok)], device=self.runner.device)
                ok = bool(self.runner.ctx.world.all_reduce(flag, op="min").item())
            if not ok:
                break  # no room yet: this header and those behind it wait
            self.queue.popleft()
            if not mine:
                continue
            kv_transfer.receive(self.runner, self.messages[header.replica], self.runner.ctx.rank, seq.blocks,
                                header.tokens, self.world, self.base)
            seq.first_token_at = header.first_at
            out.append((seq, header.started))
        return out

    def _end_aborted(self) -> None:
        """Requests aborted while their KV was on the way: ended at the tick after it came."""
        for index in [i for i in self.aborted if i in self.core.sequences]:
            self.aborted.discard(index)
            self.core.abort(index)


def _decode_loop(runner, world, inbox, outbox, prefill: Layout, prefill_base: int) -> ServeLoop:
    handoffs = Handoffs(runner, world, prefill, prefill_base)
    loop = ServeLoop(runner, inbox, outbox, inbox_hook=handoffs, command=handoffs.command, name="decode")
    handoffs.core = loop.core
    return loop
