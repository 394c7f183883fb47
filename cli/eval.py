"""atoll eval: model quality through atoll's own ranks.

    atoll eval perplexity --model DIR [--text FILE] [--window N] [--max-tokens N] [engine options]
        exp(mean NLL) of the text, in windows (engine/driver/perplexity.py); --text defaults to torch's
        README (the long description in the installed torch's METADATA)
    atoll eval greedy --model DIR --kv-cache-dtype int8 [--prompts 16] [--new-tokens 64]
        greedy tokens of prompts cut from the same text, under these engine options and under
        the same options with --kv-cache-dtype auto: how many tokens agree

perplexity with --kv-cache-dtype fp8 --calculate-kv-scales: the scoring runs decode steps only
(engine/driver/perplexity.py), so no first prefill would fit the scales; the text's first
window is prefilled first through the engine's own fit (cli/calibrate_kv.fitted_scales_file),
and the windows are scored with the scales it fitted.
"""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

from atoll.cli.calibrate_kv import fitted_scales_file
from atoll.cli.generate import add_model_options, make_llm
from atoll.engine.driver import perplexity
from atoll.engine.sample.sampler import SamplingParams
from atoll.errors import InputError
from atoll.models.gguf import demo_model_dir


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="model quality through atoll's ranks: perplexity, greedy agreement")
    evals = p.add_subparsers(dest="eval", metavar="EVAL", required=True)
    ppl = evals.add_parser("perplexity", help="perplexity of a text, scored window by window")
    _common(ppl)
    ppl.add_argument("--window", type=int, default=256, help="tokens per window (each scored from an empty cache)")
    ppl.add_argument("--max-tokens", type=int, default=None, help="score at most this many tokens of the text")
    ppl.set_defaults(run=run_perplexity)
    greedy = evals.add_parser("greedy", help="greedy tokens under these options vs --kv-cache-dtype auto")
    _common(greedy)
    greedy.add_argument("--prompts", type=int, default=16, help="prompts, consecutive pieces of the text")
    greedy.add_argument("--prompt-tokens", type=int, default=32)
    greedy.add_argument("--new-tokens", type=int, default=64)
    greedy.set_defaults(run=run_greedy)


def _common(p) -> None:
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory, or 'demo' (SmolLM2-135M)")
    p.add_argument("--text", metavar="FILE", default=None,
                   help="a UTF-8 text file (default: torch's README, from the installed torch's METADATA)")
    p.add_argument("--json", action="store_true", help="one JSON line instead of text")
    add_model_options(p)


def _setup(args):
    """(llm, token ids of the text, the text's name)."""
    model = args.model
    if model == "demo":
        model = demo_model_dir()
    if args.layout == "auto":
        raise InputError("atoll eval takes an explicit layout (--layout TP2 or -tp/-pp), not auto")
    llm = make_llm(args, model)
    if llm.tokenizer is None:
        raise InputError(f"{model} has no tokenizer.json: atoll eval reads a text")
    if args.text is None:
        text, name = perplexity.default_text(), f"torch {importlib.metadata.version('torch')} README"
    else:
        path = Path(args.text)
        if not path.is_file():
            raise InputError(f"--text {args.text}: no such file")
        text, name = path.read_text(encoding="utf-8"), path.name
    return llm, llm.tokenizer.encode(text), name


def run_perplexity(args) -> int:
    llm, ids, name = _setup(args)
    wins = perplexity.windows(ids, args.window, args.max_tokens)
    fitted = None
    if llm.options.calculate_kv_scales:  # the scoring feeds decode steps only: fit on a prefill first
        with llm:
            fitted = fitted_scales_file(llm, wins)
        args.calculate_kv_scales, args.kv_scales = False, fitted
        llm = make_llm(args, llm.model_dir)
    try:
        with llm:
            scores = perplexity.run_scores(llm, wins)
    finally:
        if fitted is not None:
            Path(fitted).unlink(missing_ok=True)
    row = {"model": str(llm.model_dir.name), "text": name, "layout": str(llm.layout),
           "kv_cache_dtype": llm.options.kv_cache_dtype, "quantization": llm.options.quantization,
           "kv_scales": "first-prefill fit" if fitted else llm.options.kv_scales,
           "windows": len(wins), "window": args.window,
           "tokens": scores.tokens, "perplexity": round(scores.perplexity, 4)}
    print(json.dumps(row) if args.json else
          f"perplexity {row['perplexity']:.4f} over {row['tokens']} tokens ({len(wins)} windows of {args.window}) "
          f"of {name}; {row['model']} {row['layout']}, KV {row['kv_cache_dtype']}, "
          f"weights {row['quantization'] or 'unquantized'}")
    return 0


def run_greedy(args) -> int:
    llm, ids, name = _setup(args)
    n, k = args.prompts, args.prompt_tokens
    if len(ids) < n * k:
        raise InputError(f"the text has {len(ids)} tokens, fewer than {n} prompts of {k}")
    prompts = [ids[i * k:(i + 1) * k] for i in range(n)]
    params = SamplingParams(max_tokens=args.new_tokens, temperature=0.0, ignore_eos=True)
    outs = []  # the unquantized run (KV auto, weights as stored), then the one asked for
    o = llm.options
    setting = (o.kv_cache_dtype, o.quantization, o.kv_scales, o.calculate_kv_scales)
    for kv, quant, scales, calculate in (("auto", None, None, False), setting):
        args.kv_cache_dtype, args.quantization, args.kv_scales, args.calculate_kv_scales = kv, quant, scales, calculate
        with make_llm(args, llm.model_dir) as run:
            outs.append([o.token_ids for o in run.generate(prompts, params)])
    ref, got = outs
    same = sum(a == b for r, g in zip(ref, got) for a, b in zip(r, g))
    prefix = sum(_common_prefix(r, g) for r, g in zip(ref, got))
    row = {"model": str(llm.model_dir.name), "text": name, "layout": str(llm.layout),
           "kv_cache_dtype": llm.options.kv_cache_dtype, "quantization": llm.options.quantization,
           "kv_scales": "first-prefill fit" if o.calculate_kv_scales else o.kv_scales,
           "prompts": n, "new_tokens": args.new_tokens,
           "tokens": n * args.new_tokens, "same_position": same, "before_first_difference": prefix,
           "identical_sequences": sum(r == g for r, g in zip(ref, got))}
    print(json.dumps(row) if args.json else
          f"KV {row['kv_cache_dtype']}, weights {row['quantization'] or 'unquantized'} vs KV auto unquantized, "
          f"{n} prompts x {args.new_tokens} greedy tokens: {same}/{row['tokens']} "
          f"equal by position, {prefix} before each sequence's first difference, "
          f"{row['identical_sequences']}/{n} sequences identical")
    return 0


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n
