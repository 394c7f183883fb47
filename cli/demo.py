"""atoll demo: the real SmolLM2-135M-Instruct answering questions across 3 local ranks."""

from __future__ import annotations

import time

from rich.console import Console

from atoll.engine.sample.sampler import SamplingParams
from atoll.launch.api import LLM
from atoll.models.gguf import demo_model_dir

QUESTIONS = [
    "What is the capital of France?",
    "Give me three tips for staying focused while studying.",
    "Explain in one sentence what a GPU is.",
    "Write a short poem about the sea.",
]


def add_parser(sub) -> None:
    p = sub.add_parser("demo", help="run the bundled SmolLM2-135M model across local ranks")
    p.add_argument("--layout", default="TP3", help="parallel layout (default TP3: 9 heads, 3 KV heads)")
    p.add_argument("--max-new-tokens", type=int, default=48)
    p.set_defaults(run=run)


def run(args) -> int:
    console = Console(stderr=True)
    model_dir = demo_model_dir()
    # a small cache suffices; four short answers do not repay compiling the decode step
    llm = LLM(model_dir, layout=args.layout, max_model_len=1024, max_num_seqs=8, enforce_eager=True)
    console.print(f"[bold]atoll demo[/]: SmolLM2-135M-Instruct from {model_dir} at {llm.layout} "
                  f"({llm.layout.world_size} local ranks); loading...")
    start = time.perf_counter()
    outs = llm.generate(QUESTIONS, SamplingParams(max_tokens=args.max_new_tokens), chat=True)
    elapsed = time.perf_counter() - start
    out = Console()
    for q, o in zip(QUESTIONS, outs):
        out.print(f"[bold cyan]Q:[/] {q}")
        out.print(f"[bold green]A:[/] {o.text.strip()}\n")
    tokens = sum(len(o.token_ids) for o in outs)
    console.print(f"{len(outs)} answers, {tokens} tokens in {elapsed:.1f}s "
                  f"(start-up and model load included) at {llm.layout}")
    return 0
