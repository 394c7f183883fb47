"""LLM: the library API. Validates everything a user can get wrong before any rank starts,
then runs the ranks and returns one RequestOutput per prompt, in order."""

from __future__ import annotations

import itertools
import numbers
import warnings
import weakref
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import torch

from atoll import config
from atoll.engine.spec import registry as drafters
from atoll.engine.driver.disagg import DisaggEngine, disagg_job
from atoll.engine.kv.sizing import check_fits, explicit_blocks
from atoll.engine.batch.copies import expand, gather
from atoll.engine.batch.lanes import lane_count
from atoll.engine.driver.elastic import ElasticEngine, check_elastic
from atoll.engine.driver.living import engine_spec, lane_load, run_through
from atoll.engine.driver.online import OnlineEngine
from atoll.engine.driver.token_params import token_params
from atoll.engine.sample.grammar import Grammars
from atoll.engine.batch.request import Request
from atoll.engine.rank.run_spec import RunSpec, resolve_dtype
from atoll.engine.sample.sampler import SamplingParams
from atoll.engine.batch.tokenizer import Tokenizer
from atoll.engine.rank.job import EngineJob
from atoll.engine.worker import worker
from atoll.errors import CheckpointError, ConfigError, InputError, LaunchError, LayoutError
from atoll.models import quantize
from atoll.engine.kv.sizing import kv_bytes_per_block
from atoll.models.checkpoint import Checkpoint
from atoll.models.config import ModelConfig
from atoll.models.jsonfile import read_json_object
from atoll.models.shape_check import check_layout_fits
from atoll.parallel.layout import Layout, resolve_layout
from atoll.parallel.mesh import ContextOptions


@dataclass
class RequestOutput:
    id: object
    text: str | None
    token_ids: list[int]
    finish_reason: str | None
    metrics: dict = field(default_factory=dict)
    error: str | None = None
    logprobs: list[dict] | None = None  # per output token, when asked: {"logprob", "top": [(id, lp), ...]}
    # per prompt token, when asked: None for the first, then {"token", "logprob", "rank", "top"}
    prompt_logprobs: list | None = None
    # n > 1: every copy's output, in order (the fields above are the first copy's)
    outputs: list["RequestOutput"] | None = None

    def to_json(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None or k == "text"}


def default_stop_ids(model_dir: Path, config: ModelConfig, tokenizer) -> tuple[int, ...]:
    ids = set(config.eos_token_id)
    gen = model_dir / "generation_config.json"
    if gen.exists():

        eos = read_json_object(gen).get("eos_token_id")
        eos = eos if isinstance(eos, list) else [] if eos is None else [eos]
        if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in eos):
            raise CheckpointError(f"{gen}: eos_token_id={eos!r} must be a token id or a list of them")
        ids.update(eos)
    if tokenizer is not None and tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return tuple(sorted(ids))


def _short(value) -> str:
    text = repr(value)  # repr escapes lone surrogates: the message stays writable
    return text if len(text) <= 40 else text[:37] + "..."


def _token_ids(ids, vocab_size: int, name: str) -> list[int]:
    """ids as a list of ints, each a whole number in the vocabulary (no bools, no floats)."""
    if hasattr(ids, "tolist") and not isinstance(ids, list):  # a tensor or an array
        ids = ids.tolist()
    if not isinstance(ids, (list, tuple)):
        raise InputError(f"{name}={_short(ids)} must be a list of token ids")
    if not ids:
        raise InputError(f"{name} is empty")
    for j, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, numbers.Integral):
            raise InputError(f"{name}[{j}]={_short(t)} is not an integer token id")
        if not 0 <= t < vocab_size:
            raise InputError(f"{name}[{j}]={t} is outside the vocabulary: token ids are 0..{vocab_size - 1}")
    return [int(t) for t in ids]


class LLM:
    """`LLM(model, layout=..., launcher=..., **options)`: options are EngineConfig's fields
    (config/engine.py: device, dtype, max_num_seqs, max_model_len, block_size, kv_cache_gb,
    enforce_eager, enable_prefix_caching, kernels, ...), over the ATOLL_* environment, with the
    same defaults as the CLI. `prefill="TP2", decode="TP4"` instead of a layout runs
    disaggregated prefill and decode (engine.driver.disagg), under a launcher that can start a
    living job (atoll.LLM's); `self.layout` is then the decode engine's.

    `launcher` runs a function on every rank: launcher(fn, world_size, *args, device=...,
    timeout_s=..., **kwargs) -> every rank's return value, as launch.local.run_local does. The
    engine imports no launcher; `atoll.LLM` (launch.api) is this class handed the local one."""
    def __init__(self, model: str | Path, *, layout: str | Layout | None = None,
                 tensor_parallel_size: int | None = None, pipeline_parallel_size: int | None = None,
                 data_parallel_size: int | None = None, expert_parallel_size: int | None = None,
                 context_parallel_size: int | None = None, launcher=None, **options):
        self.launcher = launcher
        self._engine: OnlineEngine | None = None
        self.links: dict | None = None  # the last engine's bytes by link class, with link_stats
        try:
            self.options = config.resolve(options)
        except TypeError as e:  # a keyword of the wrong kind
            raise InputError(f"LLM: {e}") from None
        except ConfigError as e:  # an unknown keyword, or a bad ATOLL_* variable
            raise InputError(f"LLM: {e}") from None
        self.model_dir = Path(model)
        self.config = ModelConfig.load(self.model_dir)
        self.prefill_layout = None
        if self.options.prefill is not None:  # disaggregated: the decode engine is `layout`
            if layout is not None or any((tensor_parallel_size, pipeline_parallel_size,
                                          data_parallel_size, expert_parallel_size, context_parallel_size)):
                raise InputError("give --prefill/--decode or a layout, not both")
            layout = self.options.decode
            self.prefill_layout = self._prefill_layout(self.options.prefill)
            if launcher is not None and not getattr(launcher, "disaggregates", False):
                raise LaunchError("disaggregated prefill and decode run as one living job: use atoll.LLM's local "
                                  "or Ray launcher (this launcher runs one job per call)")
        self.layout = resolve_layout(layout, tensor_parallel_size, pipeline_parallel_size,
                                     data_parallel_size, expert_parallel_size,
                                     context_parallel_size).validate(self.config)
        if self.layout.dp > 1 and not self.config.is_moe:
            raise LayoutError(f"layout {self.layout}: attention data parallelism (dp > 1) is for MoE "
                              f"models; for {self.config.model_type} run replicas of a tp/pp layout")
        if self.layout.cp > 1 and (self.options.speculative_config is not None or self.prefill_layout is not None):
            raise LayoutError(f"layout {self.layout}: context parallelism does not combine with speculative "
                              "decoding or disaggregated prefill yet")
        if self.options.elastic_ep:
            check_elastic(self.layout, self.options, disaggregated=self.prefill_layout is not None)
        if self.options.fault_injection is not None:
            self.options.fault_injection.check_ranks(self.layout.world_size)
        Checkpoint(self.model_dir).check()
        check_layout_fits(self.model_dir, self.config, self.layout)  # shapes, before any rank starts
        quantize.check(self.options.quantization, self.config, self.options.device)
        # the drafter's own checks (its layout, its draft model, its checkpoint tensors), before any rank starts
        drafters.check(self.options.speculative_config, self.layout, self.config, self.model_dir)
        o = self.options
        self.device, self.dtype = o.device, o.dtype
        self.max_num_seqs, self.block_size = o.max_num_seqs, o.block_size
        self.max_model_len = min(o.max_model_len or self.config.max_position_embeddings,
                                 self.config.max_position_embeddings)
        self.max_num_batched_tokens = o.batched_tokens(_device_memory_gib(o.device))
        blocks = self._explicit_blocks()
        if blocks is not None:
            check_fits(blocks, block_size=o.block_size, max_model_len=self.max_model_len, cp=self.layout.cp)
            self._check_lanes(blocks)
        self.tokenizer = None
        if (self.model_dir / "tokenizer.json").exists():
            self.tokenizer = Tokenizer(self.model_dir)
        self.stop_ids = default_stop_ids(self.model_dir, self.config, self.tokenizer)
        # structured outputs: each request's grammar compiled here first, a bad one refused by name
        self.grammars = Grammars(self.model_dir, self.config.vocab_size, self.stop_ids[0] if self.stop_ids else None)

    def _prefill_layout(self, text: str) -> Layout:
        layout = Layout.parse(text).validate(self.config)
        if layout.dp > 1:
            raise InputError(f"--prefill {layout}: the prefill engine is one replica (dp 1)")
        if layout.cp > 1:
            raise LayoutError(f"--prefill {layout}: context parallelism does not combine with disaggregated "
                              "prefill yet")
        check_layout_fits(self.model_dir, self.config, layout)
        return layout

    def _explicit_blocks(self) -> int | None:
        """--num-blocks, or --kv-cache-gb in blocks at the dtype the ranks will most likely use
        (they check again with the dtype they resolve)."""
        o = self.options
        if o.num_blocks is None and o.kv_cache_gb is None:
            return None
        device = torch.device("cuda" if o.device != "cpu" and torch.cuda.is_available() else "cpu")
        itemsize = resolve_dtype(o.dtype, self.config, device).itemsize
        per_block = kv_bytes_per_block(self.config, self.layout, itemsize, o.block_size, kv_cache_dtype=o.kv_cache_dtype)
        return explicit_blocks(bytes_per_block=per_block,
                               kv_cache_gb=o.kv_cache_gb, num_blocks=o.num_blocks)

    def _check_lanes(self, num_blocks: int) -> None:
        """Pipelined decode wants room for one max-length sequence per stage (engine.batch.lanes)."""
        pp = self.layout.pp
        lanes = lane_count(num_blocks=num_blocks, block_size=self.block_size,
                           max_model_len=self.max_model_len, depth=pp, cp=self.layout.cp)
        if lanes < pp:
            warnings.warn(f"the KV cache holds {num_blocks * self.block_size} tokens per replica, room for "
                          f"{lanes} max_model_len={self.max_model_len} sequences: {lanes} of {pp} pipeline stages "
                          f"get a micro-batch each step; raise --kv-cache-gb or --num-blocks, or lower "
                          f"--max-model-len", stacklevel=3)

    def _prompt_ids(self, prompt, chat: bool) -> list[int]:
        """One prompt's token ids: text, a list of token ids, or a request dict holding one of
        'prompt' (text) and 'prompt_token_ids'. InputError says what is wrong with it."""
        if isinstance(prompt, dict):
            has_text, has_ids = "prompt" in prompt, "prompt_token_ids" in prompt
            if has_text and has_ids:
                raise InputError("give 'prompt' or 'prompt_token_ids', not both")
            if not has_text and not has_ids:
                raise InputError("a request needs 'prompt' (text) or 'prompt_token_ids' (a list of token ids)")
            if has_ids:
                return _token_ids(prompt["prompt_token_ids"], self.config.vocab_size, "prompt_token_ids")
            prompt = prompt["prompt"]
            if not isinstance(prompt, str):
                raise InputError(f"prompt={_short(prompt)} must be a text string (or give prompt_token_ids)")
        if not isinstance(prompt, str):
            if isinstance(prompt, (bytes, dict)) or not hasattr(prompt, "__len__"):
                raise InputError(f"prompt={_short(prompt)} must be text or a list of token ids")
            return _token_ids(prompt, self.config.vocab_size, "prompt")
        if not prompt:
            raise InputError("prompt is empty")
        try:
            prompt.encode("utf-8")
        except UnicodeEncodeError as e:  # JSON's "\ud800": a lone surrogate no tokenizer can take
            raise InputError(f"prompt holds {prompt[e.start]!r} at character {e.start}, a lone surrogate: "
                             "not valid Unicode text") from None
        if self.tokenizer is None:
            raise InputError(f"{self.model_dir} has no tokenizer.json: give prompt_token_ids")
        ids = self.tokenizer.encode_chat(prompt) if chat else self.tokenizer.encode(prompt)
        if not ids:
            raise InputError("prompt encodes to no tokens")
        return _token_ids(ids, self.config.vocab_size, "the tokenized prompt")

    def prepare(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None,
                *, chat: bool = False, errors: dict | None = None):
        """Requests (token ids and params) for the workers. A bad prompt raises InputError naming
        it; given `errors`, its reason goes to errors[i] instead and it is left out, so the
        others still run (Request.index stays i, the prompt's position)."""
        if not prompts:
            raise InputError("no prompts given")
        params = params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise InputError(f"{len(plist)} SamplingParams for {len(prompts)} prompts: give one, or one per prompt")
        requests = []
        for i, (prompt, p) in enumerate(zip(prompts, plist)):
            try:
                p = token_params(p, vocab_size=self.config.vocab_size, tokenizer=self.tokenizer,
                                 model_dir=self.model_dir, grammars=self.grammars)
                ids = self._prompt_ids(prompt, chat)
                if len(ids) + 1 > self.max_model_len:
                    raise InputError(f"prompt has {len(ids)} tokens; the context is {self.max_model_len} "
                                     "(max_model_len), with room for at least one new token")
            except InputError as e:
                if errors is None:
                    raise InputError(f"prompt {i}: {e}") from None
                errors[i] = str(e)
                continue
            if not p.ignore_eos:
                p = replace(p, stop_token_ids=tuple(sorted(set(p.stop_token_ids) | set(self.stop_ids))))
            requests.append(Request(i, ids, p))
        return requests

    def spec(self, requests=None):
        """The RunSpec every rank gets. Given the requests, the context is bounded by the longest
        one (prompt + max_tokens) and the default CPU cache by how many sequences can run at
        once, so a short prompt does not reserve max_num_seqs x max_model_len of memory."""
        max_len, seqs, steps = self.max_model_len, None, None
        if requests:
            need = max(len(r.prompt_token_ids) + r.params.max_tokens for r in requests)
            max_len = min(max_len, need)
            seqs, steps = lane_load(requests, self.layout, self.max_num_seqs)
        return RunSpec(str(self.model_dir), str(self.layout), self.options, max_model_len=max_len,
                       max_num_batched_tokens=self.max_num_batched_tokens, cache_seqs=seqs,
                       decode_steps=steps)

    def context_options(self, islands=None, nodes=None):
        """What each rank's ParallelContext needs besides the layout: islands and nodes (rank ->
        island id, node id; None: one per host)."""
        return ContextOptions(islands=islands, nodes=nodes)

    def finish(self, prompts: list, requests, results: list[dict], errors: dict | None = None) -> list[RequestOutput]:
        """One RequestOutput per request: prompts[k], requests[k] and results[k] belong together
        (results[k] None: it failed, with the line errors[k])."""
        outs = []
        for k, (prompt, req, res) in enumerate(zip(prompts, requests, results)):
            rid = prompt.get("id", req.index) if isinstance(prompt, dict) else req.index
            if res is None:
                outs.append(RequestOutput(rid, None, [], None, error=(errors or {}).get(k, "no result")))
                continue
            copies = [self._output(rid, req.params, r) for r in res.get("copies", [res])]
            out = copies[0]
            outs.append(replace(out, outputs=copies) if len(copies) > 1 else out)
        return outs

    def _output(self, rid, params: SamplingParams, res: dict) -> RequestOutput:
        """One copy's output: its text cut at the first stop string past min_tokens."""
        tokens, reason = res["token_ids"], res["finish_reason"]
        text = self.tokenizer.decode(tokens) if self.tokenizer else None
        if text is not None and params.stop:
            start = len(self.tokenizer.decode(tokens[:params.min_tokens])) if params.min_tokens else 0
            cut = [at for at in (text.find(s, start) for s in params.stop) if at >= 0]
            if cut:
                text, reason = text[: min(cut)], "stop"
        return RequestOutput(rid, text, tokens, reason, res["metrics"], logprobs=res.get("logprobs"),
                             prompt_logprobs=res.get("prompt_logprobs"))

    def run(self, fn, world_size: int, *args, timeout_s: float | None = None, **kwargs) -> list:
        """fn on every rank through this LLM's launcher; every rank's value."""
        if self.launcher is None:
            raise LaunchError("this LLM was made without a launcher: use atoll.LLM, or pass launcher= "
                              "(e.g. atoll.launch.local.run_local)")
        return self.launcher(fn, world_size, *args, timeout_s=timeout_s, device=self.options.device, **kwargs)

    @property
    def living(self) -> bool:
        """Whether this LLM keeps its ranks between calls: its launcher can start a lasting
        job (launch.api's launchers can; a disaggregated one, the local launcher only)."""
        if self.prefill_layout is not None:
            return getattr(self.launcher, "disaggregates", False)
        return hasattr(self.launcher, "start")

    def start(self, requests=None, *, parallel: ContextOptions | None = None, link_stats: bool = False) -> OnlineEngine:
        """The living engine, started (ranks spawned, weights loaded) on first use and kept
        until close(); one whose ranks failed is replaced by a new one. `link_stats`: the
        engine counts its bytes by link class, in `engine.links` once closed."""
        if self._engine is not None and self._engine.error is None:
            return self._engine
        if not self.living:
            raise LaunchError("this LLM's launcher runs one job per call (no start()); use atoll.LLM's launchers")
        if self.prefill_layout is not None:
            engine = DisaggEngine(disagg_job(self, requests), launcher=self.launcher,
                                  min_prompt_tokens=self.options.disagg_min_prompt_tokens,
                                  max_prefill_queue=self.options.disagg_max_prefill_queue)
        else:
            kind = ElasticEngine if self.options.elastic_ep else OnlineEngine
            engine = kind(engine_spec(self, requests), world_size=self.layout.world_size, launcher=self.launcher,
                          parallel=parallel or self.context_options(), link_stats=link_stats)
        self._engine = engine
        self._finalizer = weakref.finalize(self, engine.close)  # at garbage collection and at exit
        return engine

    def close(self) -> None:
        """Stop the ranks; a later generate starts new ones."""
        engine, self._engine = self._engine, None
        if engine is not None:
            self._finalizer.detach()
            engine.close()
            self.links = getattr(engine, "links", None)  # bytes by link class, when it counted them

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: list, params: SamplingParams | list[SamplingParams] | None = None,
                 *, chat: bool = False, timeout_s: float | None = None, on_result=None,
                 on_step=None) -> list[RequestOutput]:
        """One RequestOutput per prompt, in order. on_result(k, result) as request k ends and
        on_step(done, tokens) as tokens come (living engines). A request that fails while the
        engine serves on (a disaggregated job's dead engine) has its line in `error`; when the
        engine itself dies, EngineDead is raised."""
        requests, errors = self.prepare(prompts, params, chat=chat), {}
        results = self.generate_requests(requests, timeout_s=timeout_s, on_result=on_result, on_step=on_step,
                                         errors=errors)
        return self.finish(prompts, requests, results, errors)

    def generate_requests(self, requests, *, timeout_s: float | None = None, on_result=None, on_step=None,
                          parallel: ContextOptions | None = None, link_stats: bool = False,
                          errors: dict | None = None) -> list:
        """prepare()'s requests run to the end: one result dict per request, in order. With
        `link_stats`, the bytes by link class are in `self.links` once the engine closed
        (a one-shot launcher's job: at once). `errors`: see engine.driver.living.run_through."""
        if self.living:
            engine = self.start(requests, parallel=parallel, link_stats=link_stats)
            return run_through(engine, requests, timeout_s=timeout_s, on_result=on_result, on_step=on_step,
                               errors=errors, share=self.prefill_layout is None)
        if self.options.elastic_ep:
            check_elastic(self.layout, launcher=self.launcher)  # a launcher of one job per call: refused
        # a launcher that runs one job per call: the same rank loop, fed every request (copy) at once
        ids = itertools.count()
        engine_requests, groups = expand(requests, lambda: next(ids))
        job = EngineJob.colocated(self.spec(engine_requests), parallel or self.context_options(),
                                  link_stats=link_stats)
        out = self.run(worker, self.layout.world_size, job, requests=engine_requests, timeout_s=timeout_s)[0]
        if link_stats:
            out, self.links = out
        return [gather([out[i] for i in group]) for group in groups]


def _device_memory_gib(device: str) -> float | None:
    """The memory of the GPU the ranks will most likely use (the first one), None on the CPU:
    the step's default token budget follows it (config.default_batched_tokens)."""
    if device == "cpu" or not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 2**30
