"""atoll spec: speculative decoding's tools. `atoll spec train-eagle3` trains an EAGLE-3 head.

    atoll spec train-eagle3 --model DIR|demo --out DIR [--prompts N] [--prompt-file FILE]
                            [--max-new-tokens N] [--steps N] [--time SECONDS] [--ttt N] [--draft-vocab N]
                            [--batch N] [--save-sequences FILE | --sequences FILE]

The target (atoll's own ranks, greedy) continues each prompt (chat-templated; from --prompt-file,
one a line, else a built-in set of questions, cli/spec_prompts.py); --save-sequences keeps the
continuations (JSON lines) and --sequences trains on kept ones without generating; the head is then trained on those sequences
after SpecForge's recipe (models/eagle3_train.py) for --steps steps or --time seconds, whichever
ends first, and written to --out in the layout published for vLLM and SGLang, which
`{"method": "eagle3", "model": OUT}` loads.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

from atoll.cli.spec_prompts import builtin_prompts
from atoll.errors import InputError

HELP = "speculative decoding's tools: train-eagle3 trains an EAGLE-3 head for a checkpoint"

def add_parser(sub) -> None:
    p = sub.add_parser("spec", help=HELP, description=__doc__.split("\n\n")[0])
    verbs = p.add_subparsers(dest="verb", required=True, metavar="VERB")
    t = verbs.add_parser("train-eagle3", help="train an EAGLE-3 head from the target's own greedy continuations")
    t.add_argument("--model", required=True, help="the target's checkpoint directory, or 'demo' (SmolLM2-135M)")
    t.add_argument("--out", required=True, help="the head's directory (config.json, model.safetensors)")
    t.add_argument("--prompt-file", default=None, help="prompts, one a line (default: a built-in set)")
    t.add_argument("--prompts", type=int, default=48, help="prompts used at most (default 48)")
    t.add_argument("--max-new-tokens", type=int, default=160, help="tokens the target continues each (default 160)")
    t.add_argument("--steps", type=int, default=400, help="optimizer steps (default 400)")
    t.add_argument("--batch", type=int, default=8, help="sequences a step, padded (default 8)")
    t.add_argument("--warmup", type=int, default=50, help="steps of linear learning-rate warmup (default 50)")
    t.add_argument("--save-sequences", default=None, help="write the target's continuations here (JSON lines)")
    t.add_argument("--sequences", default=None, help="train on continuations kept by --save-sequences")
    t.add_argument("--time", type=float, default=None, help="stop training after this many seconds")
    t.add_argument("--ttt", type=int, default=4, help="training-time-test unroll steps (default 4)")
    t.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size (default 8192)")
    t.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate (default 1e-3)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    p.set_defaults(run=run)


def prompt_texts(path, n: int) -> list[str]:
    if path is None:
        texts = builtin_prompts()
    else:
        f = Path(path)
        if not f.is_file():
            raise InputError(f"--prompt-file {path} is not a file")
        texts = [line.strip() for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
        if not texts:
            raise InputError(f"--prompt-file {path} holds no prompt")
    return texts[:n]


def read_sequences(path) -> list[tuple[list[int], int]]:
    f = Path(path)
    if not f.is_file():
        raise InputError(f"--sequences {path} is not a file")
    try:
        rows = [json.loads(line) for line in f.read_text(encoding="utf-8").splitlines() if line.strip()]
        return [(list(r["tokens"]), int(r["prompt_len"])) for r in rows]
    except (ValueError, KeyError, TypeError) as e:
        raise InputError(f"--sequences {path} is not what --save-sequences writes: {e}") from None


def run(args) -> int:
    for name in ("prompts", "max_new_tokens", "steps", "ttt", "draft_vocab", "batch"):
        if getattr(args, name) < 1:
            raise InputError(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    if args.warmup < 0:
        raise InputError(f"--warmup {args.warmup} must be at least 0")
    if args.time is not None and args.time <= 0:
        raise InputError(f"--time {args.time} must be above 0")
    from atoll import LLM, SamplingParams
    from atoll.engine.batch.tokenizer import Tokenizer
    from atoll.models.eagle3_train import train_head
    from atoll.models.gguf import demo_model_dir

    model = str(demo_model_dir()) if args.model == "demo" else args.model
    if args.sequences is not None:
        sequences = read_sequences(args.sequences)
        generated = None
    else:
        tok = Tokenizer(model)
        ids = [tok.encode_chat(t) for t in prompt_texts(args.prompt_file, args.prompts)]
        print(f"atoll: the target continues {len(ids)} prompts ({args.max_new_tokens} tokens at most each)",
              file=sys.stderr)
        start = time.monotonic()
        from tqdm import tqdm

        with LLM(model) as llm, tqdm(total=len(ids), unit="prompt", desc="continuing", disable=args.json,
                                     dynamic_ncols=True, mininterval=1.0) as bar:
            outs = llm.generate(ids, SamplingParams(max_tokens=args.max_new_tokens),
                                on_result=lambda k, result: bar.update(1))
        generated = time.monotonic() - start
        sequences = [(p + list(o.token_ids), len(p)) for p, o in zip(ids, outs)]
        if args.save_sequences is not None:
            Path(args.save_sequences).write_text(
                "".join(json.dumps({"tokens": t, "prompt_len": n}) + "\n" for t, n in sequences), encoding="utf-8")
    summary = train_head(model, sequences, args.out, steps=args.steps, seconds=args.time, ttt=args.ttt,
                         vocab_size=args.draft_vocab, lr=args.lr, seed=args.seed, progress=not args.json,
                         batch=args.batch, warmup=args.warmup)
    summary["generate_seconds"] = generated
    summary["out"] = args.out
    if args.json:
        print(json.dumps(summary))
    else:
        acc = ", ".join("-" if a is None else f"{a:.2f}" for a in summary["accuracy"])
        print(f"EAGLE-3 head written to {args.out}: {summary['steps']} steps in {summary['seconds']:.0f} s on "
              f"{summary['sequences']} sequences ({summary['tokens']} tokens, {summary['counted']} continued), "
              f"draft vocabulary {summary['draft_vocab']} (holds {summary['vocab_coverage']:.1%} of the target's "
              f"argmaxes), layers {summary['aux_layers']}; training accuracy by unroll step: {acc}")
    return 0
