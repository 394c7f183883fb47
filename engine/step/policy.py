"""Whether a run compiles its decode step, and with which backend: `build(runner)`.

EngineConfig.compile (--compile, env ATOLL_COMPILE; --enforce-eager means never):
- never: every step eager (its products tuned for this CPU, engine.rank.tuning.tune_eager, except
  under --enforce-eager).
- always: compile at once (the CPU's inductor graph, CUDA graphs on a GPU).
- auto (the default): on CUDA capture (a few seconds); on the CPU compile only when the run's
  expected decode steps x the time a compiled step saves reach the expected compile time, less
  5% of the steps' eager time (AMORTIZE: a compile that costs a job that little is worth making,
  since later runs find it in inductor's cache), so the default never makes a job slower than
  eager by more than that and a misestimate. The steps come
  from the requests (RunSpec.decode_steps: their max_tokens, an upper bound when a sequence
  stops early; unknown: compile, as before). The times come from this machine's record
  (`cache_path / "decode_steps.json"`): each run adds its eager and compiled step times and its
  compile time, cold or from inductor's cache, under a key of the model, layout, dtype,
  buckets, weight packing and torch version. Without a record they are estimated from the
  model's size, on the side that does not compile: a cold compile of a 30-layer model is then
  taken as ~16.5 s. A graph inductor already holds compiles in seconds, so once a run has
  compiled, a long job repays it.

Rank 0 decides and every rank of the job takes its answer (one broadcast at build), since
each node reads its own record.
"""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import torch

from atoll.engine.step.compiled import CompiledDecode, inductor_cache_dir
from atoll.engine.step.graphs import GraphedDecode
from atoll.engine.step.memory import copy_fits

RECORD = "decode_steps.json"
# estimated cold compile, 2 cores: one graph a decoder layer kind (engine.step.compiled), so the
# layer count adds little (measured 16.6 s for SmolLM2's 30 layers at load 2-3)
COLD_S_PER_LAYER, COLD_S_BASE = 0.15, 12.0
WARM_SHARE = 0.5  # a compile from inductor's cache against a cold one (measured 8.3 s / 16.6 s)
EAGER_GB_S = 10.0  # estimated eager step: the weights read at this rate (measured 58-109 ms for 0.54 GB)
# estimated compiled step speed-up over eager until a run records one. Against plain eager it
# measured 2.4x at 16 rows and short contexts and 3x at one row, but the eager step packs its
# weights for oneDNN too where that measures faster (engine.rank.tuning.tune_eager: 1.6x over plain
# eager at 16 rows), and at 16 rows decoding 256 tokens each the compiled step was no faster
# than that (its attention reads each context padded to a power of two of blocks): a cautious guess
SPEEDUP = 1.2
# a compile that would cost this job at most this share of its eager decoding is made: it is
# all but free now, and inductor's cache then serves every later run of the same job warm
AMORTIZE = 0.05


def build(runner):
    """The runner's decode step (engine.step.decode_step), or None: every step eager."""
    spec, eng = runner.spec, runner.spec.engine
    policy = "never" if eng.enforce_eager else eng.compile
    if policy == "never":
        return None
    # speculative decoding: a verify step's rows (each sequence's pending token and K drafts) are buckets too
    kw = dict(max_num_seqs=eng.max_num_seqs * (1 + (runner.spec_k or 0)), max_model_len=spec.max_model_len,
              block_size=eng.block_size, scratch_block=runner.num_blocks, rank=runner.ctx.rank)
    if runner.device.type == "cuda":
        # MLA too (its absorbed decode reads the latent cache through the static tables), and
        # MoE with DP: every replica steps at one bucket, agreed each step (runner.agree)
        return GraphedDecode(runner.model, runner.cache, **kw)
    if runner.device.type != "cpu" or runner.config.is_moe or runner.config.is_mla or eng.quantization == "fp8":
        # fp8 weights on the CPU dequantize per product, and the CPU's inductor graphs are
        # made for the dense decoder layers: eager (not compiled yet)
        return None
    weight_bytes = sum(w.numel() * w.element_size() for w in runner.model.linear_weights())
    pack = eng.compile_freezing and copy_fits(weight_bytes, runner.ranks_here)
    runner.step_key = record_key(runner, pack)
    if policy == "auto" and not _agree(runner, lambda: decide(runner, pack, weight_bytes)):
        return None
    _thread_lock_for_tqdm()
    # a one-sequence run keeps its one-row graph for the plain steps
    return CompiledDecode(runner.model, runner.cache, freezing=pack, cache_dir=inductor_cache_dir(eng.cache_path),
                          one_row=eng.max_num_seqs == 1, **kw)


def record_key(runner, pack: bool) -> str:
    spec = runner.spec
    config = Path(spec.model_dir, "config.json")
    model = hashlib.sha1(config.read_bytes()).hexdigest()[:12] if config.is_file() else "?"
    return (f"{Path(spec.model_dir).name}:{model} {spec.layout} {str(runner.dtype).removeprefix('torch.')} "
            f"seqs {spec.engine.max_num_seqs} blocks {-(-spec.max_model_len // spec.engine.block_size)}"
            f"x{spec.engine.block_size} {'onednn' if pack else 'plain'} torch {torch.__version__}"
            + (f" {spec.engine.quantization}" if spec.engine.quantization else ""))


def expected(entry: dict, *, layers: int, weight_bytes: int, cached: bool = True) -> dict:
    """Seconds: the compile this run expects, an eager step and a compiled step, and whether
    each came from the record or an estimate. cached: whether inductor's cache may hold the
    graph (False: its directory is gone, so a cold compile)."""
    eager = entry.get("eager_step_s") or weight_bytes / (EAGER_GB_S * 1e9)
    compiled = entry.get("compiled_step_s") or eager / SPEEDUP
    if entry.get("warm_s") and cached:
        compile_s = entry["warm_s"]
    elif entry.get("cold_s") and not cached:
        compile_s = entry["cold_s"]
    elif entry.get("cold_s"):
        compile_s = entry["cold_s"] * WARM_SHARE  # compiled once: inductor's cache holds it
    else:
        compile_s = COLD_S_BASE + COLD_S_PER_LAYER * layers
    return {"compile_s": compile_s, "eager_step_s": eager, "compiled_step_s": compiled,
            "measured": sorted(k for k in ("warm_s", "cold_s", "eager_step_s", "compiled_step_s") if entry.get(k))}


def repays(steps: int | None, e: dict) -> bool:
    """Whether `steps` decode steps save what the compile costs, within AMORTIZE of their eager
    time (unknown steps: yes)."""
    if steps is None:
        return True
    return steps * (e["eager_step_s"] - e["compiled_step_s"] + AMORTIZE * e["eager_step_s"]) >= e["compile_s"]


def decide(runner, pack: bool, weight_bytes: int) -> bool:
    """Rank 0's answer for the auto policy, said on stderr."""
    spec = runner.spec
    entry = load(spec.engine.cache_path).get(runner.step_key, {})
    where = inductor_cache_dir(spec.engine.cache_path)
    e = expected(entry, layers=runner.model.num_local_layers, weight_bytes=weight_bytes,
                 cached=where is None or Path(where).is_dir())
    steps = spec.decode_steps
    go = repays(steps, e)
    if steps is not None:
        saves = steps * (e["eager_step_s"] - e["compiled_step_s"])
        source = "recorded" if e["measured"] else "estimated"
        print(f"atoll: {'compiling' if go else 'not compiling'} the decode step: ~{steps} decode steps would save "
              f"~{saves:.1f} s against ~{e['compile_s']:.0f} s of compiling ({source}; --compile always|never "
              "decides)", file=sys.stderr, flush=True)
    return go


def _agree(runner, decide_here) -> bool:
    """Rank 0's decision on every rank."""
    ctx = runner.ctx
    go = bool(decide_here()) if ctx.rank == 0 else False
    if ctx.layout.world_size == 1:
        return go
    t = torch.tensor([int(go)], dtype=torch.long, device=runner.device)
    return bool(ctx.world.broadcast(t, src=0)[0])


def load(cache_path) -> dict:
    try:
        return json.loads((Path(cache_path) / RECORD).read_text())
    except (OSError, ValueError):
        return {}


def save_run(runner, eager_step_s: list[float]) -> None:
    """Adds this run's times to the record (rank 0 calls it at the end of a run). The eager
    step's time the policy weighs is the tuned one (engine.rank.tuning.tune_eager), which a long
    job runs; a job too short to tune records its plain one apart (plain_step_s), for reading."""
    key = getattr(runner, "step_key", None)
    step = runner.decode_step
    if key is None or (step is None and not eager_step_s):
        return
    path = Path(runner.spec.engine.cache_path) / RECORD
    records = load(path.parent)
    entry = records.setdefault(key, {})
    if eager_step_s:
        entry["eager_step_s" if getattr(runner, "eager_tuned", False) else "plain_step_s"] = _median(eager_step_s)
    if step is not None:
        done = step.summary()
        if done["step_s"]:
            entry["compiled_step_s"] = done["step_s"]
        if done["compile_s"]:
            entry["warm_s" if done["warm"] else "cold_s"] = done["compile_s"][0]
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(records, indent=1, sort_keys=True))
        tmp.replace(path)
    except OSError:
        pass  # a read-only cache: the next run estimates again


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _thread_lock_for_tqdm() -> None:
    """inductor's compile shows a tqdm bar, whose default lock is a multiprocessing semaphore;
    a rank leaves with os._exit, so that semaphore would be reported leaked at the job's end.
    A thread lock serves a rank, which draws no bar from other processes."""
    import threading

    from tqdm import tqdm

    tqdm.set_lock(threading.RLock())
