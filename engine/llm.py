"""LLM: the library API. Validates everything a user can get wrong before any rank starts,
then runs the ranks and returns one RequestOutput per prompt, in order."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

from atoll.engine.sampling import SamplingParams
from atoll.errors import InputError
from atoll.models.checkpoint import Checkpoint
from atoll.models.config import ModelConfig
from atoll.parallel.layout import Layout


@dataclass
class RequestOutput:
    id: object
    text: str | None
    token_ids: list[int]
    finish_reason: str | None
    metrics: dict = field(default_factory=dict)
    error: str | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None or k == "text"}


def resolve_layout(layout=None, tp: int | None = None, pp: int | None = None,
                   dp: int | None = None, ep: int | None = None) -> Layout:
    """A Layout from its text ("TP2PP2") or from vLLM-style sizes (-tp, -pp, -dp, -ep)."""
    if layout is not None:
        if any(v not in (None, 1) for v in (tp, pp, dp, ep)):
            raise InputError("give either --layout or the -tp/-pp/-dp/-ep sizes, not both")
        return layout if isinstance(layout, Layout) else Layout.parse(layout)
    if ep and not tp and not dp:
        tp = ep  # as in Layout.parse: EP alone means TP attention over the same ranks
    return Layout(tp=tp or 1, pp=pp or 1, dp=dp or 1, ep=ep or 1)


def default_stop_ids(model_dir: Path, config: ModelConfig, tokenizer) -> tuple[int, ...]:
    ids = set(config.eos_token_id)
    gen = model_dir / "generation_config.json"
    if gen.exists():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        ids.update(eos if isinstance(eos, list) else [] if eos is None else [eos])
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


class LLM:
    def __init__(self, model: str | Path, *, layout: str | Layout | None = None,
                 tensor_parallel_size: int | None = None, pipeline_parallel_size: int | None = None,
                 data_parallel_size: int | None = None, expert_parallel_size: int | None = None,
                 dtype: str = "float32", max_num_seqs: int = 32, max_model_len: int | None = None,
                 max_num_batched_tokens: int | None = None, block_size: int = 16,
                 kv_cache_gb: float | None = None, num_blocks: int | None = None):
        from atoll.engine.runner import DTYPES

        self.model_dir = Path(model)
        self.config = ModelConfig.load(self.model_dir)
        self.layout = resolve_layout(layout, tensor_parallel_size, pipeline_parallel_size,
                                     data_parallel_size, expert_parallel_size).validate(self.config)
        if self.layout.dp > 1 and not self.config.is_moe:
            from atoll.errors import LayoutError

            raise LayoutError(f"layout {self.layout}: attention data parallelism (dp > 1) is for MoE "
                              f"models; for {self.config.model_type} run replicas of a tp/pp layout")
        Checkpoint(self.model_dir).check()
        if dtype not in DTYPES:
            raise InputError(f"dtype {dtype!r} is not one of {', '.join(DTYPES)}")
        self.dtype = dtype
        self.max_num_seqs = max_num_seqs
        self.max_model_len = min(max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        if max_num_seqs < 1 or block_size < 1:
            raise InputError(f"max_num_seqs={max_num_seqs} and block_size={block_size} must be at least 1")
        self.max_num_batched_tokens = max_num_batched_tokens or max(2048, self.max_model_len)
        if self.max_num_batched_tokens < 1:
            raise InputError(f"max_num_batched_tokens={self.max_num_batched_tokens} must be at least 1")
        self.block_size = block_size
        self.num_blocks = self._size_cache(kv_cache_gb, num_blocks)
        self._check_lanes()
        self.tokenizer = None
        if (self.model_dir / "tokenizer.json").exists():
            from atoll.engine.tokenizer import Tokenizer

            self.tokenizer = Tokenizer(self.model_dir)
        self.stop_ids = default_stop_ids(self.model_dir, self.config, self.tokenizer)

    def _size_cache(self, kv_cache_gb, num_blocks) -> int:
        from atoll.engine.blocks import size_pool
        from atoll.engine.runner import DTYPES
        from atoll.layers.linear import kv_heads_per_rank
        from atoll.parallel.pipeline import stage_layers

        cfg, lay = self.config, self.layout
        layers = max(end - start for start, end in stage_layers(cfg, lay.pp))
        kv_local = kv_heads_per_rank(cfg.num_key_value_heads, lay.tp)
        itemsize = DTYPES[self.dtype].itemsize
        per_block = 2 * layers * kv_local * self.block_size * cfg.head_dim * itemsize
        # pipelined decode keeps pp micro-batches of max_num_seqs in flight (engine.lanes)
        return size_pool(bytes_per_block=per_block, block_size=self.block_size,
                         max_num_seqs=self.max_num_seqs * lay.pp,
                         max_model_len=self.max_model_len, ranks_here=lay.world_size,
                         kv_cache_gb=kv_cache_gb, num_blocks=num_blocks)

    def _check_lanes(self) -> None:
        """Pipelined decode wants room for one max-length sequence per stage (engine.lanes)."""
        from atoll.engine.lanes import lane_count

        pp = self.layout.pp
        lanes = lane_count(num_blocks=self.num_blocks, block_size=self.block_size,
                           max_model_len=self.max_model_len, depth=pp)
        if lanes < pp:
            import warnings

            warnings.warn(f"the KV cache holds {self.num_blocks * self.block_size} tokens per replica, room for "
                          f"{lanes} max_model_len={self.max_model_len} sequences: {lanes} of {pp} pipeline stages "
                          f"get a micro-batch each step; raise --kv-cache-gb or --num-blocks, or lower "
                          f"--max-model-len", stacklevel=3)

    def _prompt_ids(self, prompt, chat: bool) -> list[int]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                prompt = list(prompt["prompt_token_ids"])
            elif "prompt" in prompt:
                prompt = prompt["prompt"]
            else:
                raise InputError("a request needs 'prompt' or 'prompt_token_ids'")
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InputError(f"{self.model_dir} has no tokenizer.json: give prompt_token_ids")
            ids = self.tokenizer.encode_chat(prompt) if chat else self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise InputError("empty prompt")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise InputError(f"token id {bad[0]} outside the vocabulary of {self.config.vocab_size}")
        return ids

    def prepare(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None,
                *, chat: bool = False):
        """Requests (token ids and params) for the workers; raises InputError for bad ones."""
        from atoll.engine.generate import Request

        if not prompts:
            raise InputError("no prompts given")
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            ids = self._prompt_ids(prompt, chat)
            if len(ids) + 1 > self.max_model_len:
                raise InputError(f"prompt {i} has {len(ids)} tokens; the context is {self.max_model_len}")
            if not p.ignore_eos:
                p = replace(p, stop_token_ids=tuple(sorted(set(p.stop_token_ids) | set(self.stop_ids))))
            requests.append(Request(i, ids, p))
        return requests

    def spec(self):
        from atoll.engine.runner import RunSpec

        return RunSpec(str(self.model_dir), str(self.layout), self.dtype, self.max_num_seqs, self.max_model_len,
                       self.max_num_batched_tokens, self.block_size, self.num_blocks)

    def finish(self, prompts: list, requests, results: list[dict]) -> list[RequestOutput]:
        outs = []
        for prompt, req, res in zip(prompts, requests, results):
            rid = prompt.get("id", req.index) if isinstance(prompt, dict) else req.index
            tokens, reason = res["token_ids"], res["finish_reason"]
            text = self.tokenizer.decode(tokens) if self.tokenizer else None
            if text is not None and req.params.stop:
                cut = [text.find(s) for s in req.params.stop if s in text]
                if cut:
                    text, reason = text[: min(cut)], "stop"
            outs.append(RequestOutput(rid, text, tokens, reason, res["metrics"]))
        return outs

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None,
                 *, chat: bool = False, timeout_s: float | None = None) -> list[RequestOutput]:
        from atoll.engine.worker import generate_worker
        from atoll.launch.local import run_local

        requests = self.prepare(prompts, params, chat=chat)
        results = run_local(generate_worker, self.layout.world_size, self.spec(), requests,
                            timeout_s=timeout_s)[0]
        return self.finish(prompts, requests, results)
