"""atoll bench startup: what a new user waits for, start-up and compile included: `atoll
generate` as a fresh process by default (the compile policy, engine.step.policy), with
--enforce-eager, and transformers' `generate`, side by side in one run, for each --jobs entry
(PROMPTS x TOKENS, default 5x3 and 16x256).

Each job gets an empty cache directory (ATOLL_CACHE; TORCHINDUCTOR_CACHE_DIR unset), then runs,
one after another: eager, the default (first run: no record, no compiled graph), the default
again on the same cache (second run: the record from the first), --compile always (a compile
now, recorded), the default once more (after a compile: inductor's cache holds the graph), and
transformers (AutoModelForCausalLM float32, the prompts as one left-padded batch, greedy,
max_new_tokens, as many threads as atoll). Reported per run: the process's wall time, the
median time to first token of its requests (from the request's start, after the model load),
whether the default compiled, and whether its tokens equal the eager run's. The prompts are
text asking for long answers, and every side makes all TOKENS of each (atoll --ignore-eos,
transformers min_new_tokens), so the work is the job's size.
The 1-minute load average is read before and after each job.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from atoll.errors import ConfigError
from atoll.models.gguf import demo_model_dir

TOPICS = ["the sea", "a mountain village", "the history of clocks", "a robot learning to paint", "winter in a city",
          "the first trip to Mars", "a lighthouse keeper", "bees and flowers", "a library at night",
          "a long train journey", "the invention of paper", "a storm at sea", "a small bakery", "the moon",
          "an old map", "a desert oasis"]

HF_SCRIPT = r"""
import json, sys, torch
from transformers import AutoModelForCausalLM, AutoTokenizer
model_dir, prompts, new = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
tok = AutoTokenizer.from_pretrained(model_dir)
tok.padding_side = "left"
if tok.pad_token is None:
    tok.pad_token = tok.eos_token
model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
batch = tok(prompts, return_tensors="pt", padding=True)
with torch.inference_mode():
    out = model.generate(**batch, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                         pad_token_id=tok.pad_token_id)
print(json.dumps({"tokens": int(out[:, batch["input_ids"].shape[1]:].numel())}))
"""


def add_parser(sub) -> None:
    p = sub.add_parser("startup", help="atoll generate (default, --enforce-eager) and transformers, "
                                       "start-up and compile included, first and second run",
                       description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="checkpoint dir (default: the demo model, SmolLM2-135M)")
    p.add_argument("--jobs", default="5x3,16x256", help="PROMPTSxTOKENS, comma-separated (default 5x3,16x256)")
    p.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    p.set_defaults(run=run)


def parse_jobs(text: str) -> list[tuple[int, int]]:
    jobs = []
    for part in text.split(","):
        n, _, t = part.strip().partition("x")
        if not (n.isdigit() and t.isdigit() and int(n) > 0 and int(t) > 0):
            raise ConfigError(f"--jobs {part.strip()!r}: expected PROMPTSxTOKENS such as 16x256")
        jobs.append((int(n), int(t)))
    return jobs


def run(args) -> int:
    jobs = parse_jobs(args.jobs)
    model = args.model
    if model is None:
        model = str(demo_model_dir())
    results = [job(model, n, t) for n, t in jobs]
    out = {"model": model, "jobs": results}
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        render(out)
    return 0


def job(model: str, prompts: int, tokens: int) -> dict:
    texts = [f"Write a long, detailed story about {TOPICS[i % len(TOPICS)]}." for i in range(prompts)]
    with tempfile.TemporaryDirectory(prefix="atoll-startup-") as tmp:
        tmp = Path(tmp)
        (tmp / "p.jsonl").write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n" for i, p in enumerate(texts)))
        cache = tmp / "cache"
        load = [os.getloadavg()[0]]
        runs = {"eager": _atoll(model, tmp, cache, tokens, "--enforce-eager"),
                "default": _atoll(model, tmp, cache, tokens),
                "default, second run": _atoll(model, tmp, cache, tokens),
                "--compile always": _atoll(model, tmp, cache, tokens, "--compile", "always"),
                "default, after it": _atoll(model, tmp, cache, tokens)}
        runs["transformers"] = _hf(model, texts, tokens)
        load.append(os.getloadavg()[0])
        record = (cache / "decode_steps.json")
        recorded = json.loads(record.read_text()) if record.is_file() else {}
    eager = runs["eager"].get("token_ids")
    for name in ("default", "default, second run", "--compile always", "default, after it"):
        runs[name]["same_tokens_as_eager"] = runs[name].get("token_ids") == eager
    for r in runs.values():
        r.pop("token_ids", None)
    return {"prompts": prompts, "tokens": tokens, "load_1min": load, "runs": runs, "record": recorded}


def _atoll(model: str, tmp: Path, cache: Path, tokens: int, *flags: str) -> dict:
    out = tmp / f"out{time.monotonic_ns()}.jsonl"
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHINDUCTOR_CACHE_DIR", "ATOLL_ENFORCE_EAGER",
                                                            "ATOLL_COMPILE")}
    env["ATOLL_CACHE"] = str(cache)
    cmd = [sys.executable, "-m", "atoll", "generate", "--model", model, "--prompts", str(tmp / "p.jsonl"),
           "--max-new-tokens", str(tokens), "--ignore-eos", "--output", str(out), "--no-progress", *flags]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"wall_s": wall, "error": proc.stderr.strip().splitlines()[-1:] or [f"exit {proc.returncode}"]}
    lines = [json.loads(x) for x in out.read_text().splitlines() if x.strip()]
    ttft = [ln["metrics"]["ttft_s"] for ln in lines if ln.get("metrics")]
    said = [ln for ln in proc.stderr.splitlines() if "compil" in ln]
    return {"wall_s": wall, "ttft_s": statistics.median(ttft) if ttft else None,
            "tokens": sum(len(ln.get("token_ids") or []) for ln in lines),
            "token_ids": [ln.get("token_ids") for ln in lines], "compile": said}


def _hf(model: str, texts: list[str], tokens: int) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-c", HF_SCRIPT, model, json.dumps(texts), str(tokens)],
                          capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"wall_s": wall, "error": proc.stderr.strip().splitlines()[-1:]}
    return {"wall_s": wall, **json.loads(proc.stdout.strip().splitlines()[-1])}


def render(out: dict) -> None:
    print(f"atoll bench startup: {out['model']}")
    for j in out["jobs"]:
        runs = j["runs"]
        eager = runs["eager"]["wall_s"]
        print(f"\n{j['prompts']} prompts x {j['tokens']} tokens (load average {j['load_1min'][0]:.2f} -> "
              f"{j['load_1min'][1]:.2f})")
        print(f"  {'run':<22}{'wall s':>9}{'vs eager':>10}{'TTFT s':>9}{'tokens':>8}  compiled / same tokens")
        for name, r in runs.items():
            if "error" in r:
                print(f"  {name:<22} failed: {r['error']}")
                continue
            ttft = f"{r['ttft_s']:.2f}" if r.get("ttft_s") is not None else "-"
            note = ""
            if name != "eager" and name != "transformers":
                compiled = any(line.startswith("atoll: compiled") for line in r["compile"])
                note = f"{'compiled' if compiled else 'eager'} / {r['same_tokens_as_eager']}"
            print(f"  {name:<22}{r['wall_s']:>9.1f}{r['wall_s'] / eager:>9.2f}x{ttft:>9}{r.get('tokens', 0):>8}  {note}")
        for name, r in runs.items():
            for line in r.get("compile", []):
                print(f"    {name}: {line}")
