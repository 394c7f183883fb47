"""The prefill and decode roles of a disaggregated job: X prefill engines of one layout, then
Y decode engines of another (xPyD; parallel.parts lays the engines' ranks one after another),
each running its own rank loop (engine.rank.loop) over its own ranks, with these hooks for
the hand-off between them. engine/worker.py starts them; the driver is engine/driver/disagg.py.
Every engine's loop holds both roles' hooks (EngineRoles): the driver may turn a drained, idle
engine to the other role at run time (engine.disagg.routing), and headers name engines by their
id in the job, so any engine hands off to any other.

Hand-off, per request routed to the prefill engine:
1. The driver adds it to a prefill engine with max_tokens 1, naming the decode engine and its
   replica.
2. As its first token is sampled, the prefill rank that sampled it puts a header on the
   driver's outbox (index, first token, prompt length, when it started and took its first
   token, and with random sampling the generator's state after that token), and every
   rank of that prefill engine sends its share of the prompt's KV to that decode replica
   (engine.disagg.transfer); the send waits until the decode ranks receive it. Each prefill rank
   then reports the bytes it sent.
3. The driver passes the header to that decode engine's rank 0, which broadcasts it with the
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

from atoll.engine.disagg import transfer as kv_transfer
from atoll.engine.sample.sampler import SamplerState
from atoll.engine.batch.scheduler import Sequence
from atoll.engine.rank.loop import ServeLoop
from atoll.parallel.layout import Layout


@dataclass(frozen=True)
class Header:
    index: int
    prefill: int  # the prefill engine that computed the prompt (its id in the job)
    decode: int  # the decode engine that goes on (its id in the job)
    first: int  # the first token, sampled by the prefill engine
    tokens: int  # prompt length: the positions whose KV comes over
    replica: int  # the decode replica
    started: float  # time.perf_counter() in the prefill engine when it took the request
    first_at: float  # ... when it sampled the first token (one machine: one clock)
    rng: bytes | None = None  # the generator's state after the first token


class PrefillHooks:
    """The prefill side: each prompt's first token and KV sent to the decode engine (global
    engine id, as parallel.parts lays them out) and replica the driver named."""

    def __init__(self, runner, world, outbox, me: int, layouts: list[Layout], bases: list[int]):
        self.runner, self.world, self.outbox, self.me = runner, world, outbox, me
        self.layouts, self.bases = layouts, bases
        self.messages: dict[tuple[int, int], list] = {}  # (decode engine, replica) -> the transfer's messages
        self.route: dict[int, tuple[int, int]] = {}  # request index -> (decode engine, its replica)

    def command(self, cmd) -> None:
        if cmd[0] == "route":  # ("route", index, decode engine, replica), just before its add
            self.route[cmd[1]] = (cmd[2], cmd[3])

    def _plan(self, j: int, d: int) -> list:
        if (j, d) not in self.messages:
            self.messages[j, d] = kv_transfer.plan(self.runner.config, self.runner.ctx.layout, self.layouts[j], d)
        return self.messages[j, d]

    def on_token(self, seq, started) -> None:
        runner, ctx = self.runner, self.runner.ctx
        index, tokens = seq.request.index, len(seq.request.prompt_token_ids)
        j, d = self.route.pop(index)
        if ctx.rank == runner.sampler_rank:  # its generator drew the first token
            generator = seq.state.generator
            rng = generator.get_state().numpy().tobytes() if generator is not None else None
            self.outbox.put(("handoff", Header(index, self.me, j, seq.output[0], tokens, d, started,
                                               seq.first_token_at, rng)))
        try:
            sent = kv_transfer.send(runner, self._plan(j, d), ctx.rank, seq.blocks, tokens, self.world, self.bases[j])
        except RuntimeError:  # its decode engine died (gloo: the connection closed); the driver ends it
            sent = 0
        self.outbox.put(("sent", index, sent))

    def forward(self, index, result) -> bool:  # its decode engine reports the end, unless it never got there
        self.route.pop(index, None)
        return result["finish_reason"] == "abort"


class Handoffs:
    """The decode side: headers in the order they came, adopted in that order (EngineCore's
    inbox). Requests aborted before their KV came are still received, then ended."""

    def __init__(self, runner, world, layouts: list[Layout], bases: list[int], outbox=None):
        """layouts, bases: every engine's of the job (a header names its prefill engine's id)."""
        self.runner, self.world, self.layouts, self.bases, self.outbox = runner, world, layouts, bases, outbox
        ctx = runner.ctx
        self.replica, self.replicas = ctx.coords.dp, ctx.layout.dp
        self.messages: dict[tuple[int, int], list] = {}  # (prefill engine, replica) -> the transfer's messages
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
            seq = self._sequence(header, req, tick) if mine else None
            ok = lanes.adopt(seq, tick) if mine else True
            if self.replicas > 1:  # only the named replica decides; every decode rank follows it
                flag = torch.tensor([int(ok)], device=self.runner.device)
                ok = bool(self.runner.ctx.world.all_reduce(flag, op="min").item())
            if not ok:
                break  # no room yet: this header and those behind it wait
            self.queue.popleft()
            if not self._received(header, seq if mine else None):
                continue
            if not mine:
                continue
            seq.first_token_at = header.first_at
            out.append((seq, header.started))
        return out

    def _received(self, header: Header, seq: Sequence | None) -> bool:
        """Receive the prompt's KV into seq's blocks (seq None: another replica's request). If
        its prefill engine died on the way (gloo's receive fails at once), every rank of this
        engine drops the request together, and rank 0 tells the driver ("lost")."""
        ok = True
        if seq is not None:
            try:
                key = header.prefill, header.replica
                if key not in self.messages:
                    self.messages[key] = kv_transfer.plan(self.runner.config, self.layouts[header.prefill],
                                                          self.runner.ctx.layout, header.replica)
                kv_transfer.receive(self.runner, self.messages[key], self.runner.ctx.rank,
                                    seq.blocks, header.tokens, self.world, self.bases[header.prefill])
            except RuntimeError:
                ok = False
        ctx = self.runner.ctx
        if ctx.world.size > 1:
            flag = torch.tensor([int(ok)], device=self.runner.device)
            ok = bool(ctx.world.all_reduce(flag, op="min").item())
        if not ok:
            if seq is not None:
                self.core.lanes.end(seq)  # its blocks go back; the driver ends the request
            if ctx.rank == 0 and self.outbox is not None:
                self.outbox.put(("lost", header.index, header.prefill))
        return ok

    def _sequence(self, header: Header, req, tick: int) -> Sequence:
        """The request as the prefill engine left it: its first token, and with random sampling
        its generator where the first token left it."""
        state = SamplerState(req.params, self.runner.device, grammars=self.runner.grammars)
        if state.generator is not None and header.rng is not None:
            state.generator.set_state(torch.frombuffer(bytearray(header.rng), dtype=torch.uint8))
        return Sequence(req, state, output=[header.first], arrived_step=tick)

    def _end_aborted(self) -> None:
        """Requests aborted while their KV was on the way: ended at the tick after it came."""
        for index in [i for i in self.aborted if i in self.core.sequences]:
            self.aborted.discard(index)
            self.core.abort(index)


class EngineRoles:
    """One engine's rank loop in either role, its hooks swapped at a step boundary when the
    driver says ("role", "prefill" | "decode") (it does so only to a drained, idle engine whose
    layout is the role's). me: the engine's id in the job; layouts, bases: every engine's."""

    def __init__(self, runner, world, inbox, outbox, me: int, layouts: list[Layout], bases: list[int], role: str):
        self.loop = ServeLoop(runner, inbox, outbox, command=self.command)
        self.prefill = PrefillHooks(runner, world, outbox, me, layouts, bases)
        self.handoffs = Handoffs(runner, world, layouts, bases, outbox)
        self.handoffs.core = self.loop.core
        self.role = None
        self.take(role)

    def take(self, role: str) -> None:
        loop, core = self.loop, self.loop.core
        decode = role == "decode"
        core.on_token = None if decode else self.prefill.on_token
        core.inbox = self.handoffs if decode else None
        loop.forward = None if decode else self.prefill.forward
        # a decode engine's cached blocks route prompts; with a shared KV store a prefill engine's are
        # written there too, so the driver hears of them
        loop.cache_events = decode or bool(loop.runner.spec.engine.kv_shared)
        for lane in core.lanes.schedulers:
            lane.pool.events = [] if loop.cache_events else None
        self.role = role

    def command(self, cmd) -> None:
        if cmd[0] == "role":
            self.take(cmd[1])
        elif self.role == "prefill":
            self.prefill.command(cmd)
        else:
            self.handoffs.command(cmd)
