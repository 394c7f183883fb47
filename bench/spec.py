"""atoll bench spec: the same requests with speculative decoding off and on, side by side in
one run on the same ranks.

--speculative-config JSON is the `on` side (as `atoll generate` takes it); given more than
once, each is a side of its own (named by its method), all run against the same off side. --prompts picks
the load: `copy` asks the model to repeat or lightly edit a given text (what n-gram prompt
lookup is for), `chat` asks ordinary questions. --batch requests arrive at once and run
together (max_num_seqs = --batch); each generates --output-len tokens (greedy, ignore_eos),
so every side must give identical tokens. The ranks are spawned once and build the runner
once; each round runs off and every on side (the order reversed every other round) after an
untimed warm-up of each (every prompt, 4 tokens). Reported, medians over --rounds: output tokens per second, the ratio on /
off, the acceptance rate and mean accepted length (engine.spec.stats), whether the tokens
are identical, and the 1-minute load average read before each timed run. By default both
sides decode eagerly (--compile never), with the products engine.rank.tuning.tune_eager chose for
the verify step's rows; with --compile always both run the compiled CPU decode step, whose
buckets hold a verify step's rows too (both sides run the same weights and graphs, every graph
made by the step's warm-up before the first timed run).
"""

from __future__ import annotations

import dataclasses
import os
import statistics
import time

from atoll.bench.harness import Run
from atoll.config.speculative import SpeculativeConfig
from atoll.engine.batch.tokenizer import Tokenizer
from atoll.engine.rank.loop import run_batch
from atoll.engine.rank.runner import ModelRunner
from atoll.engine.sample.sampler import SamplingParams
from atoll.engine.spec import stats as spec_stats
from atoll.errors import ConfigError
from atoll.launch.api import LLM
from atoll.launch.local import run_local
from atoll.parallel.layout import Layout
from atoll.parallel.mesh import ParallelContext

# each text longer than the default --output-len, so a faithful copy or light edit of it is the
# whole answer (texts shorter than the output let the model run on into unrelated text)
TEXTS = [
    "The committee met on Tuesday to review the budget for the coming year. After a long discussion, "
    "the members agreed to increase spending on public libraries by ten percent, to repair the old bridge "
    "over the river, and to delay the new parking garage until the spring. The treasurer warned that the "
    "cost of heating the town hall had doubled since last winter, and asked the members to look for savings "
    "in the other departments before the next meeting. Two members proposed closing the swimming pool on "
    "Mondays, but the others said that the pool was used by the schools on that day and should stay open. "
    "In the end the committee decided to ask each department for a written list of possible savings, to be "
    "sent to the treasurer by the end of the month, and to meet again in six weeks to choose among them.",
    "Photosynthesis is the process by which green plants use sunlight to make food from carbon dioxide and "
    "water. It takes place mainly in the leaves, inside small structures called chloroplasts, and it "
    "releases oxygen into the air as a by-product. The green pigment in the chloroplasts, chlorophyll, "
    "absorbs red and blue light and reflects green light, which is why most leaves look green to us. The "
    "energy captured from the light is used to split water into hydrogen and oxygen, and the hydrogen is "
    "then joined with carbon dioxide to build sugars. Plants use these sugars to grow and to store energy "
    "for the night and for the winter. Almost every living thing on land depends on this process, either by "
    "eating plants or by eating animals that eat plants, and the oxygen we breathe comes from it too.",
    "To reset your password, open the settings page, choose the account tab, and press the button marked "
    "reset. A message with a link will be sent to your email address. Follow the link within one hour, "
    "then type your new password twice and save it. Your new password must be at least twelve characters "
    "long and must not be the same as any of your last five passwords. If the message does not arrive within "
    "a few minutes, look in your spam folder, and make sure that the email address on your account is the "
    "one you are checking. If you no longer have access to that address, contact the help desk by phone "
    "during office hours and have your account number ready. For your safety, the help desk will never ask "
    "you to tell them your password, and you should not share it with anyone, even a colleague.",
    "The train to the coast leaves the central station every hour from six in the morning until ten at "
    "night. Tickets can be bought at the machines in the hall or on the train itself, and children under "
    "twelve travel free when they are with an adult. The journey takes about two hours and stops at five "
    "towns on the way, the largest of which is the market town in the valley, where many people change for "
    "the bus to the mountains. On weekends in the summer an extra train runs every half hour, and bicycles "
    "may be taken on board at no extra cost, as long as there is room in the first carriage. There is a "
    "small cafe on the platform at the coast, and the beach is a short walk from the station along the "
    "main street, past the harbour and the old lighthouse.",
]
COPY = ["Repeat the following text exactly, word for word:\n\n{}",
        "Fix any spelling mistakes in this text and write it out again in full:\n\n{}",
        "Rewrite this text exactly as it is, keeping every sentence:\n\n{}",
        "Copy this paragraph:\n\n{}"]
CHAT = ["What is the capital of France?", "Give me three tips for sleeping better.",
        "Explain what a rainbow is to a child.", "Write a short poem about the sea.",
        "What are the benefits of drinking water?", "How do I make a cup of tea?",
        "Name some animals that live in the desert.", "Why is the sky blue?"]


def add_parser(sub) -> None:
    p = sub.add_parser("spec", help="speculative decoding off vs on: tokens/s, acceptance",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--speculative-config", required=True, metavar="JSON", action="append",
                   help='the on side, e.g. {"method": "ngram", "num_speculative_tokens": 4}; repeat it for '
                        'more sides')
    p.add_argument("--model", default=None, help="checkpoint dir (default: the demo model, SmolLM2-135M)")
    p.add_argument("--layout", default="TP1", help="atoll layout (default TP1)")
    p.add_argument("--prompts", choices=("copy", "chat"), default="copy", help="the load (default copy)")
    p.add_argument("--batch", type=int, default=1, help="requests running together (default 1)")
    p.add_argument("--requests", type=int, default=None, help="requests per run (default: --batch, at least 4)")
    p.add_argument("--output-len", type=int, default=128, help="generated tokens per request (default 128)")
    p.add_argument("--rounds", type=int, default=1, help="rounds, each running off and on (default 1)")
    p.add_argument("--compile", choices=("never", "always"), default="never",
                   help="never: both sides eager (default); always: both sides through the compiled CPU "
                        "decode step, verify steps included")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run)


def run(args) -> int:
    for name in ("batch", "output_len", "rounds"):
        if getattr(args, name) < 1:
            raise ConfigError(f"--{name.replace('_', '-')} {getattr(args, name)} must be at least 1")
    configs = [SpeculativeConfig.parse(c) for c in args.speculative_config]
    names = side_names(configs)
    with Run(args.model, quiet=args.json) as bench:
        args.model = bench.model
        llm, spec, requests = prepare(args, configs)
        result = run_local(_rank, llm.layout.world_size, spec, requests, args.rounds, dict(zip(names, configs)),
                           timeout_s=3600, device=spec.engine.device)[0]
    result |= {"model": args.model, "layout": str(llm.layout), "prompts": args.prompts, "batch": args.batch,
               "requests": len(requests), "output_len": args.output_len, "rounds": args.rounds,
               "speculative_config": args.speculative_config[0], "configs": dict(zip(names, args.speculative_config))}
    bench.emit(result, as_json=args.json, render=render)
    return 0


def prompts(kind: str, n: int) -> list[str]:
    if kind == "copy":
        return [COPY[i % len(COPY)].format(TEXTS[i % len(TEXTS)]) for i in range(n)]
    return [CHAT[i % len(CHAT)] for i in range(n)]


def side_names(configs: list) -> list[str]:
    """"on" for one config; else each method's name (numbered when a method repeats)."""
    if len(configs) == 1:
        return ["on"]
    methods = [c.method for c in configs]
    return [m if methods.count(m) == 1 else f"{m}{methods[:i].count(m) + 1}" for i, m in enumerate(methods)]


def prepare(args, configs: list):
    """(LLM, RunSpec with the widest config's speculation on, requests) for the chosen prompts."""
    speculative = max(configs, key=lambda c: c.k)
    n = args.requests or max(args.batch, 4)
    tok = Tokenizer(args.model)
    ids = [tok.encode_chat(t) for t in prompts(args.prompts, n)]
    llm = LLM(args.model, layout=args.layout, max_num_seqs=args.batch, compile=args.compile, enforce_eager=False,
              max_model_len=max(map(len, ids)) + args.output_len + speculative.k + 1)
    requests = llm.prepare(ids, SamplingParams(max_tokens=args.output_len, ignore_eos=True))
    return llm, llm.spec(requests).with_engine(speculative_config=speculative), requests


def _rank(rank: int, world: int, spec, requests, rounds: int, configs: dict, device: str = "cpu") -> dict | None:
    layout = Layout.parse(spec.layout)
    ctx = ParallelContext.create(layout, rank, device) if world > 1 else ParallelContext.single(device)
    runner = ModelRunner(spec, ctx)
    if runner.decode_step is not None:  # --compile always: every graph made before any timed run
        runner.decode_step.warm_up()
    sides = {"off": spec.with_engine(speculative_config=None)}
    sides |= {name: spec.with_engine(speculative_config=c) for name, c in configs.items()}
    # untimed: every prompt and a few decode steps on each side, so the first timed run does
    # not pay for the batch's first allocations
    warm = [dataclasses.replace(r, params=dataclasses.replace(r.params, max_tokens=4, min_tokens=min(r.params.min_tokens, 4)))
            for r in requests]
    for side in sides.values():
        runner.spec = side
        run_batch(runner, warm)
    runs = {name: [] for name in sides}
    for i in range(rounds):
        for name in (list(sides) if i % 2 == 0 else list(sides)[::-1]):
            runner.spec = sides[name]
            ctx.world.barrier()
            runs[name].append(measure(runner, requests))
    runner.spec = spec
    if rank != 0:
        return None
    out = {name: summarize(r) for name, r in runs.items()}
    for name in configs:
        out[name]["speedup"] = out[name]["tok_s"] / out["off"]["tok_s"]
    first = next(iter(configs))
    return out | {"device": str(runner.device), "sides": list(configs), "on": out[first],
                  "speedup": out[first]["speedup"],
                  "tokens_identical": all(r["token_ids"] == runs["off"][0]["token_ids"]
                                          for side in runs.values() for r in side)}


def measure(runner, requests) -> dict:
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    results = run_batch(runner, requests)
    total = time.perf_counter() - t0
    tokens = sum(len(r["token_ids"]) for r in results)
    return {"total_s": total, "tok_s": tokens / total, "load_avg_1m": load,
            "spec": spec_stats.summarize([r["metrics"] for r in results]),
            "token_ids": [r["token_ids"] for r in results]}


def summarize(runs: list[dict]) -> dict:
    out = {"tok_s": statistics.median(r["tok_s"] for r in runs),
           "total_s": statistics.median(r["total_s"] for r in runs),
           "load_avg_1m": [round(r["load_avg_1m"], 2) for r in runs],
           "runs_s": [round(r["total_s"], 2) for r in runs]}  # each round's time, in order
    if runs[0]["spec"] is not None:
        out["drafted"] = sum(r["spec"]["drafted"] for r in runs)
        out["acceptance_rate"] = statistics.median(r["spec"]["acceptance_rate"] for r in runs)
        out["mean_accepted_length"] = statistics.median(r["spec"]["mean_accepted_length"] for r in runs)
    return out


def render(r: dict) -> str:
    lines = [f"speculative decoding on {r['model']} ({r['layout']}, {r['device']}): {r['prompts']} prompts, "
             f"batch {r['batch']}, {r['requests']} requests x {r['output_len']} tokens, {r['rounds']} round(s)",
             *(f"  {name}: {c}" for name, c in r.get("configs", {"on": r["speculative_config"]}).items())]
    sides = r.get("sides", ["on"])
    width = max(map(len, ["off", *sides]))
    for name in ("off", *sides):
        s = r[name]
        extra = (f", acceptance {s['acceptance_rate']:.1%}, mean accepted length {s['mean_accepted_length']:.2f}"
                 if s.get("drafted") else ", no drafts made (disable_by_batch_size)" if "drafted" in s else "")
        ratio = f" {s.get('speedup', r['speedup']):.2f}x" if name != "off" else ""
        lines.append(f"  {name:>{width}}: {s['tok_s']:8.1f} tok/s ({s['total_s']:.2f} s){ratio}{extra}"
                     f"  load {s['load_avg_1m']}")
    lines.append(f"  tokens identical: {r['tokens_identical']}")
    return "\n".join(lines)
