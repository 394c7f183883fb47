"""The requests of a serving load, as `atoll bench serve` sends them and `atoll simulate` replays
them: random token ids (lengths fixed or uniform within --range-ratio), a JSONL of prompts,
prompts sharing a few system prefixes, a mix with a share of long prompts, or conversations
whose every turn repeats the conversation so far (multi_turn_requests); and their
arrival times (vLLM's: gamma-distributed gaps of shape `burstiness` and mean 1/rate, so 1 is
Poisson; rate inf sends them all at once). Pure functions of their seeds: the same command line
gives the same requests to the server and to the simulator.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from atoll.engine.batch.tokenizer import Tokenizer
from atoll.errors import ConfigError, InputError
from atoll.planner.sim.engine import token_at



@dataclass(frozen=True)
class BenchRequest:
    prompt: list[int] | str  # token ids, or text
    output_len: int  # max_tokens (and min_tokens with ignore_eos)
    after: int | None = None  # a conversation's later turn: sent when request `after` (its index) ends

    @property
    def prompt_len(self) -> int | None:
        """Tokens sent, when the prompt is token ids."""
        return len(self.prompt) if isinstance(self.prompt, list) else None


def random_requests(n: int, *, input_len: int, output_len: int, vocab_size: int, seed: int = 0,
                    range_ratio: float = 0.0) -> list[BenchRequest]:
    """n prompts of uniformly random token ids; with range_ratio r, each length is drawn
    uniformly from [len * (1 - r), len * (1 + r)] (vLLM's --random-range-ratio), at least 1."""
    if not 0 <= range_ratio < 1:
        raise ConfigError(f"--range-ratio {range_ratio}: must be in [0, 1)")
    rng = np.random.default_rng(seed)  # numpy's: ten million token ids in a fraction of a second

    def lengths(mean: int) -> list[int]:
        lo, hi = max(1, math.floor(mean * (1 - range_ratio))), max(1, math.ceil(mean * (1 + range_ratio)))
        return rng.integers(lo, hi + 1, size=n).tolist()

    isl, osl = lengths(input_len), lengths(output_len)
    ids = rng.integers(0, vocab_size, size=sum(isl)).tolist()
    out, at = [], 0
    for i, o in zip(isl, osl):
        out.append(BenchRequest(ids[at:at + i], o))
        at += i
    return out


def jsonl_requests(path: str, n: int, *, output_len: int) -> list[BenchRequest]:
    """The first n lines of a JSONL file, each {"prompt": text or token ids} with an optional
    "output_len" (or "max_tokens"); fewer lines than n are cycled."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"--dataset {path}: no such file")
    rows = []
    for ln, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{ln}: not JSON ({e.msg})") from None
        prompt = row.get("prompt") if isinstance(row, dict) else None
        ok_ids = isinstance(prompt, list) and prompt and all(isinstance(t, int) and t >= 0 for t in prompt)
        if not (isinstance(prompt, str) and prompt) and not ok_ids:
            raise InputError(f"{path}:{ln}: needs \"prompt\": a non-empty text or list of token ids")
        osl = row.get("output_len", row.get("max_tokens", output_len))
        if isinstance(osl, bool) or not isinstance(osl, int) or osl < 1:
            raise InputError(f"{path}:{ln}: output_len={osl!r} must be a whole number of at least 1")
        rows.append(BenchRequest(prompt, osl))
    if not rows:
        raise InputError(f"--dataset {path}: no prompts")
    return [rows[i % len(rows)] for i in range(n)]


def arrival_times(n: int, *, rate: float, burstiness: float = 1.0, seed: int = 0) -> list[float]:
    """Seconds from the start at which each of n requests is sent: 0 for the first, then gaps
    drawn from a gamma distribution of shape `burstiness` and scale 1 / (rate * burstiness)
    (mean 1 / rate; burstiness 1 is a Poisson process, lower is burstier); all 0 at rate inf."""
    if not rate > 0:
        raise ConfigError(f"--request-rate {rate}: must be positive (inf: all at once)")
    if not 0 < burstiness < math.inf:
        raise ConfigError(f"--burstiness {burstiness}: must be a positive number")
    if math.isinf(rate):
        return [0.0] * n
    rng = random.Random(seed)
    theta = 1.0 / (rate * burstiness)
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.gammavariate(burstiness, theta)
    return out


def shared_prefix_requests(n: int, *, systems: int, system_len: int, user_len: int, output_len: int,
                           vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """n requests, each one of `systems` shared prompts (drawn at random) and its own ids."""
    rng = random.Random(seed)
    shared = [[rng.randrange(vocab_size) for _ in range(system_len)] for _ in range(systems)]
    return [BenchRequest(shared[rng.randrange(systems)] + [rng.randrange(vocab_size) for _ in range(user_len)],
                         output_len) for _ in range(n)]


def mixed_requests(n: int, *, input_len: int, long_len: int, long_share: float, output_len: int, vocab_size: int,
                   seed: int = 0) -> list[BenchRequest]:
    """n requests of random ids: a long_share of them (at random) long_len tokens, the rest input_len."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        length = long_len if rng.random() < long_share else input_len
        out.append(BenchRequest([rng.randrange(vocab_size) for _ in range(length)], output_len))
    return out


def tokenized(requests: list[BenchRequest], model_dir) -> list[BenchRequest]:
    """The requests with text prompts turned into the model's token ids (its tokenizer.json)."""
    if not any(isinstance(r.prompt, str) for r in requests):
        return requests
    path = Path(str(model_dir))
    if not (path / "tokenizer.json").is_file():
        raise InputError(f"text prompts: {model_dir} has no tokenizer.json to count their tokens (give token ids, "
                         "or a checkpoint dir)")
    tok = Tokenizer(path)
    return [BenchRequest(tok.encode(r.prompt) if isinstance(r.prompt, str) else r.prompt, r.output_len, r.after)
            for r in requests]


def multi_turn_requests(conversations: int, *, turns: int, input_len: int, user_len: int, output_len: int,
                        vocab_size: int, seed: int = 0) -> list[BenchRequest]:
    """bench serve --scenario kv-tiers's conversations (bench/serve_tiers.py, the same first prompts
    and new ids from `seed`), for the simulator: a first prompt of input_len ids, then each later
    turn the last prompt, its answer and user_len new ids, sent when the turn before it ends. The
    answer is the one the simulator will give (engine.token_at: its stand-in tokens at the
    request's index and positions), so every turn's prompt starts with the whole history the
    engine computed. Turn by turn: request t x conversations + c is turn t of conversation c."""
    if turns < 1:
        raise ConfigError(f"--turns {turns} must be at least 1")
    rng = random.Random(seed)
    ids = lambda n: [rng.randrange(1, vocab_size - 1) for _ in range(n)]  # noqa: E731 (the bench's draw)
    firsts = [ids(input_len) for _ in range(conversations)]
    news = [[ids(user_len) for _ in range(turns - 1)] for _ in range(conversations)]
    out = [BenchRequest(p, output_len) for p in firsts]
    for t in range(1, turns):
        for c in range(conversations):
            before = (t - 1) * conversations + c
            prompt = out[before].prompt
            answer = [token_at(before, len(prompt) + j) for j in range(output_len)]
            out.append(BenchRequest(prompt + answer + news[c][t - 1], output_len, after=before))
    return out

