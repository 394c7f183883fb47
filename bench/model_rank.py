"""The ranks' side of `atoll bench` (bench/model.py says what is timed and how): each rank
builds its stage once; rank 0 also times transformers and a tensor copy, every round
alternating which side goes first; the rounds are summarized into medians and ratios."""

from __future__ import annotations

import os
import statistics
import time

import torch

from atoll.bench.harness import sig
from atoll.calibrate.timing import sync
from atoll.engine.rank.loop import run_batch
from atoll.engine.rank.runner import ModelRunner
from atoll.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext


def decode_weight_bytes(model, batch: int) -> int:
    """Parameter bytes one decode step of `batch` sequences reads on this rank."""
    # a tied LM head shares the embedding's tensor: read whole by the head
    embed = ({id(m.weight) for m in model.modules() if isinstance(m, VocabParallelEmbedding)}
             - {id(m.weight) for m in model.modules() if isinstance(m, ParallelLMHead)})
    total = 0
    for p in model.parameters():
        if id(p) in embed:
            total += min(batch, p.shape[0]) * p[0].numel() * p.element_size()
        else:
            total += p.numel() * p.element_size()
    return total


def time_atoll(runner, requests, pipelined: bool = True) -> dict:
    sync(runner.device)
    t0 = time.perf_counter()
    results = run_batch(runner, requests, pipelined=pipelined)  # syncs each step (.tolist())
    total = time.perf_counter() - t0
    # each rank's share of the run spent computing; the rest waits for activations or tokens
    busy = runner.ctx.world.all_gather(
        torch.tensor([runner.stats["busy"]], dtype=torch.float64, device=runner.device), dim=0)
    return {"total_s": total, "busy": busy.tolist(), "tokens": [len(r["token_ids"]) for r in results],
            "prefill_s": statistics.median(r["metrics"]["ttft_s"] for r in results),
            "decode_step_s": statistics.median(r["metrics"]["tpot_s"] for r in results),
            "token_ids": [r["token_ids"] for r in results]}


def _time_transformers(model, input_ids, n: int) -> dict:
    from transformers import LogitsProcessorList  # lazy: transformers, for the baseline side only

    stamps, device = [], input_ids.device

    def stamp(ids, scores):  # called once per generated token, after its forward
        sync(device)  # generate syncs each step anyway (its stopping check)
        stamps.append(time.perf_counter())
        return scores

    eos = model.generation_config.eos_token_id
    pad = eos[0] if isinstance(eos, list) else eos
    sync(device)
    t0 = time.perf_counter()
    with torch.inference_mode():
        out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                             max_new_tokens=n, min_new_tokens=n, pad_token_id=pad,
                             logits_processor=LogitsProcessorList([stamp]))
    sync(device)
    end = time.perf_counter()
    new = out[:, input_ids.shape[1]:]
    return {"total_s": end - t0, "tokens": [int(new.shape[1])] * len(new),
            "prefill_s": stamps[0] - t0, "decode_step_s": (end - stamps[0]) / (n - 1),
            "token_ids": new.tolist()}


def _time_memory(src, dst, times: int = 3) -> tuple[float, float]:
    """Median seconds of dst.copy_(src), and of reading both (src.sum(), dst.sum()). On CUDA a
    timed region runs each `reps` times between synchronizes (a 256 MiB copy takes ~0.1 ms on
    an H200, comparable to a launch plus a synchronize) and reports one run's share."""
    reps = 20 if src.device.type == "cuda" else 1
    dst.copy_(src)
    src.sum(), dst.sum()
    copy, read = [], []
    for _ in range(times):
        sync(src.device)
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src)
        sync(src.device)
        t1 = time.perf_counter()
        for _ in range(reps):
            src.sum(), dst.sum()
        sync(src.device)
        copy.append((t1 - t0) / reps)
        read.append((time.perf_counter() - t1) / reps)
    return statistics.median(copy), statistics.median(read)


def _rank(rank: int, world: int, cfg: dict, spec, requests, device: str = "cpu") -> dict | None:
    layout = Layout.parse(spec.layout)
    ctx = ParallelContext.create(layout, rank, device) if world > 1 else ParallelContext.single(device)
    runner = ModelRunner(spec, ctx)
    dev = runner.device
    weight_bytes = ctx.world.all_reduce(
        torch.tensor([decode_weight_bytes(runner.model, cfg["batch"])], dtype=torch.float64, device=dev))
    own_threads, all_threads = torch.get_num_threads(), cfg["threads"]["transformers"]
    if rank == 0:
        # lazy: transformers, for the baseline side only (rank 0's)
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging

        logging.set_verbosity_error()
        logging.disable_progress_bar()
        # the same dtype as atoll's runner, loaded once and moved (no second copy kept)
        hf = AutoModelForCausalLM.from_pretrained(spec.model_dir, dtype=runner.dtype).eval().to(dev)
        input_ids = torch.tensor([r.prompt_token_ids for r in requests], device=dev)
        src = torch.ones(cfg["copy_mib"] * 2**20 // 4, dtype=torch.float32, device=dev)
        dst = torch.empty_like(src)
        cfg = cfg | {"device": str(dev), "dtype": str(runner.dtype).removeprefix("torch."),
                     "device_name": torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"}

    def baseline():  # rank 0 alone, with every thread of the job; the others wait
        if rank == 0:
            torch.set_num_threads(all_threads)
            res = _time_transformers(hf, input_ids, cfg["output_len"]), *_time_memory(src, dst)
            torch.set_num_threads(own_threads)
        ctx.world.barrier()
        return res if rank == 0 else None

    step = runner.decode_step  # None: eager only

    def atoll(compiled: bool, pipelined: bool = True) -> dict:
        runner.decode_step = step if compiled else None
        return time_atoll(runner, requests, pipelined=pipelined)

    paths = [True, False] if step is not None else [False]  # the default path first
    rounds, pipeline, loads = [], [], []
    for i in range(cfg["warmup"] + cfg["rounds"]):
        ctx.world.barrier()
        if i % 2:
            base = baseline()
            mine = [atoll(c) for c in reversed(paths)][::-1]
        else:
            mine = [atoll(c) for c in paths]
            base = baseline()
        # under PP, the same requests again with one micro-batch in flight at a time
        one = atoll(paths[0], pipelined=False) if ctx.layout.pp > 1 else None
        if i >= cfg["warmup"] and rank == 0:
            rounds.append((mine[0], *base, mine[1] if len(mine) > 1 else None))
            loads.append(os.getloadavg()[0])
            pipeline.append((mine[0], one))
    runner.decode_step = step
    if rank != 0:
        return None
    path = "eager" if step is None else ("cuda graphs" if dev.type == "cuda" else "compiled")
    cfg = cfg | {"path": path}
    result = summarize(cfg, rounds, float(weight_bytes))
    result["load_avg_rounds"] = [round(x, 2) for x in loads]
    if step is not None:
        result["compile"] = {"buckets": step.buckets, "run": step.buckets_run,
                             "compile_s": [sig(s, 3) for _, s in step.compiles], "freezing": step.freezing,
                             "error": getattr(step, "error", None)}
    if step is not None and world == 1 and hasattr(step, "replay_seconds"):  # the GPU's share of a step
        seconds = step.replay_seconds(next(b for b in step.buckets if b >= cfg["batch"]))
        if seconds is not None:
            result["graph_replay_s"] = sig(seconds)
            result["graph_replay_of_bandwidth_floor"] = sig(result["floor_step_s"] / seconds)
    if ctx.layout.pp > 1:
        result["pipeline"] = summarize_pipeline(pipeline, ctx.layout)
    return result


def summarize(cfg: dict, rounds: list, weight_bytes: float) -> dict:
    med = statistics.median

    def side(k: int) -> dict:
        runs = [r[k] for r in rounds]
        total, tokens = med(r["total_s"] for r in runs), sum(runs[0]["tokens"])
        return {"total_s": sig(total), "output_tokens": tokens,
                "tokens_per_s": sig(tokens / total),
                "prefill_s": sig(med(r["prefill_s"] for r in runs)),
                "decode_step_s": sig(med(r["decode_step_s"] for r in runs))}

    atoll, hf = side(0), side(1)
    ratios = [r[1]["total_s"] / r[0]["total_s"] for r in rounds]  # each round pairs atoll with transformers
    two = 2 * cfg["copy_mib"] * 2**20
    bandwidth = two / med(r[2] for r in rounds)  # copy: read + write bytes per second
    read_bandwidth = two / med(r[3] for r in rounds)  # reading both tensors
    floor = weight_bytes / bandwidth
    last = rounds[-1]
    same = sum(a == b for a, b in zip(last[0]["token_ids"], last[1]["token_ids"]))
    return {"config": cfg, "atoll": atoll, "transformers": hf,
            "vs_transformers": sig(med(ratios)),  # the median of the per-round pairs
            "vs_transformers_range": [sig(min(ratios)), sig(max(ratios))],
            "decode_weight_bytes": int(weight_bytes), "copy_bandwidth_gb_s": sig(bandwidth / 1e9),
            "floor_step_s": sig(floor),
            "of_bandwidth_floor": sig(floor / atoll["decode_step_s"]),
            "transformers_of_bandwidth_floor": sig(floor / hf["decode_step_s"]),
            "read_bandwidth_gb_s": sig(read_bandwidth / 1e9),
            "of_read_bandwidth_floor": sig(weight_bytes / read_bandwidth / atoll["decode_step_s"]),
            "same_greedy_sequences": same} | _eager_side(rounds, side, floor)


def _eager_side(rounds: list, side, floor: float) -> dict:
    """With the compiled path measured, the eager one beside it (rounds[k][4]), paired with the
    same transformers runs."""
    if rounds[0][4] is None:
        return {}
    eager, compiled = side(4), side(0)
    ratios = [r[1]["total_s"] / r[4]["total_s"] for r in rounds]
    last = rounds[-1]
    pairs = [r[4]["total_s"] / r[0]["total_s"] for r in rounds]  # compiled and eager in one round
    return {"atoll_eager": eager,
            "eager_vs_transformers": sig(statistics.median(ratios)),
            "eager_vs_transformers_range": [sig(min(ratios)), sig(max(ratios))],
            "eager_of_bandwidth_floor": sig(floor / eager["decode_step_s"]),
            "compiled_vs_eager": sig(statistics.median(pairs)),
            "compiled_vs_eager_decode_step": sig(eager["decode_step_s"] / compiled["decode_step_s"]),
            "same_tokens_compiled_and_eager": last[0]["token_ids"] == last[4]["token_ids"]}


def summarize_pipeline(rounds: list, layout) -> dict:
    """Pipelined (pp lanes) against one micro-batch at a time; busy: per stage, the mean over
    its ranks of the fraction of the run spent computing (the rest is the bubble)."""
    med = statistics.median

    def stage_busy(runs) -> list[float]:
        per_rank = [med(r["busy"][k] for r in runs) for k in range(layout.world_size)]
        size = layout.stage_size
        return [sig(statistics.mean(per_rank[s * size:(s + 1) * size]), 3) for s in range(layout.pp)]

    piped, one = [r[0] for r in rounds], [r[1] for r in rounds]
    tokens = sum(piped[0]["tokens"])
    busy, busy_one = stage_busy(piped), stage_busy(one)
    return {"tokens_per_s": sig(tokens / med(r["total_s"] for r in piped)),
            "one_at_a_time_tokens_per_s": sig(tokens / med(r["total_s"] for r in one)),
            "vs_one_at_a_time": sig(med(b["total_s"] for b in one) / med(a["total_s"] for a in piped)),
            "stage_busy": busy, "bubble": sig(1 - statistics.mean(busy), 3),
            "one_at_a_time_stage_busy": busy_one, "one_at_a_time_bubble": sig(1 - statistics.mean(busy_one), 3),
            "same_tokens": piped[-1]["token_ids"] == one[-1]["token_ids"]}
