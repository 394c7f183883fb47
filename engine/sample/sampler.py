"""SamplingParams and the sampler: greedy, temperature, top-k, top-p, seeded per request,
after the request's logits processors (engine.sample.processors); logprob rows of sampled
tokens and of prompt tokens.

A seeded request's draws for output token j come from a generator seeded with
stream_seed(seed, j): a function of the seed and the token's position only, not of the draws
before it. So a request that continues on another engine with its tokens so far (a
migration: serve.replicas) draws the same tokens there as it would have here."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from atoll.config.sampling import SamplingParams
from atoll.engine.sample.grammar import GrammarState
from atoll.engine.sample.processors import ProcessorState


@dataclass
class SamplerState:
    """Per-request generator on the sampling rank's device, so a seed gives the same tokens
    whatever else is batched (on a given device: CPU and CUDA streams differ). `prompt`: the
    request's prompt ids, which repetition_penalty reads (its processors' tensors are made
    on first use, `processors`). `grammars`: the rank's compiled grammars
    (engine.sample.grammar), from which a request with structured outputs takes its matcher
    on first use (`grammar`, on the sampling rank only)."""

    params: SamplingParams
    device: str | torch.device = "cpu"
    generator: torch.Generator | None = field(default=None)
    prompt: list[int] = field(default_factory=list)
    _processors: ProcessorState | None = field(default=None, repr=False)
    grammars: object = field(default=None, repr=False)
    _grammar: GrammarState | None = field(default=None, repr=False)

    def __post_init__(self):
        if not self.params.greedy:
            self.generator = torch.Generator(device=self.device)
            seed = self.params.seed
            self.generator.manual_seed(seed if seed is not None else torch.seed())

    def at(self, position: int | None) -> torch.Generator | None:
        """The generator for output token `position`: reseeded with stream_seed(seed, position)
        when the request is seeded (None: the stream as it runs, as for an unseeded request)."""
        if position is not None and self.params.seed is not None and self.generator is not None:
            self.generator.manual_seed(stream_seed(self.params.seed, position))
        return self.generator

    @property
    def processors(self) -> ProcessorState | None:
        """The request's processors' state, or None when nothing processes its logits."""
        if self._processors is None and self.params.processed:
            self._processors = ProcessorState(self.params, self.prompt, self.device)
        return self._processors

    @property
    def grammar(self) -> GrammarState | None:
        """The request's matcher (engine.sample.grammar), or None without structured outputs."""
        if self._grammar is None and self.params.structured_outputs is not None:
            self._grammar = self.grammars.state(self.params.structured_outputs)
        return self._grammar


def stream_seed(seed: int, position: int) -> int:
    """The seed of a seeded request's draws for its output token `position` (63 bits)."""
    digest = hashlib.blake2b(f"{seed}:{position}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def sample_one(logits: torch.Tensor, state: SamplerState, position: int | None = None) -> torch.Tensor:
    """logits: [vocab] (already processed) -> token id, a 0-d tensor on logits' device (no host
    sync); position: the output token's index (a seeded request's stream: SamplerState.at)."""
    p = state.params
    if p.greedy:
        return logits.argmax()
    return torch.multinomial(probabilities(logits, p), 1, generator=state.at(position))[0]


def probabilities(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """logits: [vocab] -> the distribution a non-greedy request draws from: temperature, then
    top-k, then top-p (speculative verification, engine.sample.verify, accepts against the same)."""
    logits = logits.float() / p.temperature
    if p.top_k and p.top_k < logits.numel():
        kth = torch.topk(logits, p.top_k).values[-1]  # a 0-d tensor: no host sync
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if p.top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        cum = sorted_probs.cumsum(0)
        drop = cum - sorted_probs > p.top_p  # keep the smallest prefix reaching top_p
        sorted_probs = sorted_probs.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def sample(logits: torch.Tensor, states: list[SamplerState], positions: list[int] | None = None) -> torch.Tensor:
    """logits: [seqs, vocab] (already processed) -> [seqs] token ids; positions: each output
    token's index (sample_one)."""
    if all(s.params.greedy for s in states):
        return logits.argmax(-1)
    positions = positions or [None] * len(states)
    return torch.stack([sample_one(row, s, q) for row, s, q in zip(logits, states, positions)])


def logprob_rows(logits: torch.Tensor, tokens: torch.Tensor, k: int) -> torch.Tensor:
    """logits: [seqs, vocab], tokens: [seqs] or [seqs, w] (tokens drawn from each row: a
    request's copies draw w from one) -> [seqs, w + 2k] float64: each drawn token's
    log-probability, then the row's k likeliest tokens' log-probabilities and ids (ids are
    exact in float64), from the model's own distribution (log_softmax of the raw logits)."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    tokens = tokens.view(len(lp), -1)
    chosen = lp.gather(1, tokens.clamp(min=0)).double()
    top = torch.topk(lp, k, dim=-1) if k else None
    parts = [chosen] + ([top.values.double(), top.indices.double()] if k else [])
    return torch.cat(parts, dim=1)


def logprob_entry(row: list[float], k: int, widest: int, j: int = 0) -> dict:
    """Token j's logprobs from its logprob_rows row (made with the micro-batch's widest k):
    its own and its k likeliest alternatives', {"logprob": lp, "top": [(id, lp), ...]}."""
    w = len(row) - 2 * widest
    return {"logprob": row[j], "top": [(int(row[w + widest + i]), row[w + i]) for i in range(k)]}


def prompt_logprob_rows(logits: torch.Tensor, targets: torch.Tensor, k: int) -> torch.Tensor:
    """logits: [n, vocab] at prompt positions, targets: [n] the prompt token after each ->
    [n, 2 + 2k] float64: the target's log-probability and rank (1 for the likeliest, as vLLM
    counts), then the k likeliest tokens' log-probabilities and ids."""
    lp = torch.log_softmax(logits.float(), dim=-1)
    own = lp.gather(1, targets.view(-1, 1))
    rank = 1 + (lp > own).sum(1, keepdim=True)
    top = torch.topk(lp, k, dim=-1) if k else None
    parts = [own.double(), rank.double()] + ([top.values.double(), top.indices.double()] if k else [])
    return torch.cat(parts, dim=1)


def prompt_logprob_entry(row: list[float], token: int, k: int, widest: int) -> dict:
    """One prompt token's entry from its prompt_logprob_rows row: {"token", "logprob", "rank",
    "top": [(id, lp), ...]}."""
    return {"token": token, "logprob": row[0], "rank": int(row[1]),
            "top": [(int(row[2 + widest + i]), row[2 + i]) for i in range(k)]}
