"""What a request's sampling parameters do to the model's logits before a token is drawn, in
vLLM's order (its v1 sampler): bad words, then min_tokens and logit_bias, then the penalties
(repetition, frequency, presence). Temperature, top-k and top-p come after, in the sampler
(engine.sample.sampler.probabilities).

- bad_words: for each word (token ids), when the sequence's last generated tokens are the
  word's tokens but its last, that last token is masked (-inf). Only generated tokens count,
  as in vLLM: a word begun at the end of the prompt is not masked.
- min_tokens: while fewer tokens than that are out, every stop token is masked
  (stop_token_ids, which LLM.prepare joins with EOS unless ignore_eos).
- logit_bias: each listed token's bias is added to its logit.
- repetition_penalty (vLLM): for every token seen in the prompt or the output, a positive
  logit is divided by the penalty and a negative one multiplied by it.
- frequency_penalty, presence_penalty (OpenAI): subtracted, per occurrence and once, for each
  token the output holds.

The processed logits are what greedy argmax, sampling and speculative verification all read
(engine.sample.micro_batch): a draft token is checked against the processed distribution of
its position, computed as if the drafts before it had been generated. Logprobs stay the
model's raw ones (vLLM's default). Each sequence keeps its tensors on the sampling rank's
device (ProcessorState): its output's token counts grow with the output, so a step adds only
the tokens since the last one.
"""

from __future__ import annotations

import torch

NEG_INF = float("-inf")


class ProcessorState:
    """One sequence's tensors for its processors, on the logits' device, made on first use."""

    def __init__(self, params, prompt: list[int], device):
        self.params, self.prompt, self.device = params, prompt, device
        self.counts: torch.Tensor | None = None  # [vocab] float32: occurrences in the output
        self.counted = 0  # output tokens already in counts
        self.prompt_seen: torch.Tensor | None = None  # [vocab] bool
        p = params
        self.bias = None
        if p.logit_bias:
            ids = list(p.logit_bias)
            self.bias = (torch.tensor(ids, dtype=torch.long, device=device),
                         torch.tensor([p.logit_bias[i] for i in ids], dtype=torch.float32, device=device))
        self.stops: torch.Tensor | None = None  # the stop tokens within the vocabulary, made on first use

    def output_counts(self, output: list[int], extra: list[int], vocab: int) -> torch.Tensor:
        """[vocab] occurrences of each token in output + extra (drafts not yet taken)."""
        if self.counts is None:
            self.counts = torch.zeros(vocab, dtype=torch.float32, device=self.device)
        if len(output) > self.counted:
            new = torch.tensor(output[self.counted:], dtype=torch.long, device=self.device)
            self.counts.index_add_(0, new, torch.ones(len(new), dtype=torch.float32, device=self.device))
            self.counted = len(output)
        if not extra:
            return self.counts
        more = torch.tensor(extra, dtype=torch.long, device=self.device)
        return self.counts.clone().index_add_(0, more, torch.ones(len(more), dtype=torch.float32, device=self.device))

    def seen_in_prompt(self, vocab: int) -> torch.Tensor:
        if self.prompt_seen is None:
            self.prompt_seen = torch.zeros(vocab, dtype=torch.bool, device=self.device)
            self.prompt_seen[torch.tensor(self.prompt, dtype=torch.long, device=self.device)] = True
        return self.prompt_seen


def process_row(row: torch.Tensor, state: ProcessorState, output: list[int], extra: list[int] = ()) -> None:
    """row: [vocab] float32 logits of one position, changed in place: the sequence's
    processors applied as if output + extra had been generated before it."""
    p, vocab = state.params, row.shape[-1]
    history = list(output) + list(extra)
    for word in p.bad_words_token_ids:
        prefix = word[:-1]
        if len(prefix) <= len(history) and (not prefix or tuple(history[-len(prefix):]) == prefix):
            row[word[-1]] = NEG_INF
    if p.min_tokens and len(history) < p.min_tokens and p.stop_token_ids:
        if state.stops is None:
            state.stops = torch.tensor([t for t in p.stop_token_ids if t < vocab], dtype=torch.long,
                                       device=state.device)
        row[state.stops] = NEG_INF
    if state.bias is not None:
        row.index_add_(0, *state.bias)
    if p.repetition_penalty != 1 or p.frequency_penalty or p.presence_penalty:
        counts = state.output_counts(output, list(extra), vocab)
        if p.repetition_penalty != 1:
            seen = state.seen_in_prompt(vocab) | (counts > 0)
            scaled = torch.where(row > 0, row / p.repetition_penalty, row * p.repetition_penalty)
            row.copy_(torch.where(seen, scaled, row))
        if p.frequency_penalty:
            row.sub_(p.frequency_penalty * counts)
        if p.presence_penalty:
            row.sub_(p.presence_penalty * (counts > 0).float())


def processed(logits: torch.Tensor, rows: list[tuple]) -> torch.Tensor:
    """logits: [n, vocab] -> a float32 copy with each row's processors applied; rows[i] is
    (ProcessorState or None, output, extra) for row i (None: left as it is)."""
    out = logits.float().clone()
    for i, (state, output, extra) in enumerate(rows):
        if state is not None:
            process_row(out[i], state, output, extra)
    return out
