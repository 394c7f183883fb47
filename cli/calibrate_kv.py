"""atoll calibrate-kv: fp8 KV cache scales fitted from a text, written beside the checkpoint.

    atoll calibrate-kv --model DIR --text FILE [--window 256] [--max-tokens N] [--out FILE] [--force]

The text's windows go through atoll's own ranks (engine/rank/kv_calibration.py) and the scales
(a scale and a first-position sink for keys and for values, per layer and kv head:
layers/kv_quant.py) are written as DIR/atoll-kv-scales.json (models/kv_scales.py), which every
later run with --kv-cache-dtype fp8 reads at load, unless the checkpoint ships k_scale/v_scale
of its own (those are read first; --kv-scales FILE picks a file). A file already there is never replaced by surprise:
one calibrate-kv wrote is replaced only with --force, any other never (--out picks another
name). `atoll eval perplexity --calculate-kv-scales` uses the same rank function to learn the
scales a run's first prefill would fit (its scoring has no prefill): see fitted_scales_file.
"""

from __future__ import annotations

import dataclasses
import importlib.metadata
import sys
import tempfile
from pathlib import Path

from atoll.cli.generate import add_model_options, make_llm
from atoll.engine.driver import perplexity
from atoll.engine.rank.kv_calibration import calibrate_worker
from atoll.errors import InputError
from atoll.layers.kv_quant import CALIBRATED_RANGE
from atoll.models import kv_scales
from atoll.models.checkpoint import Checkpoint
from atoll.models.gguf import demo_model_dir

HELP = "fit fp8 KV cache scales from a text and write them beside the checkpoint"


def add_parser(sub) -> None:
    p = sub.add_parser("calibrate-kv", help=HELP, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="Hugging Face checkpoint directory, or 'demo' (SmolLM2-135M)")
    p.add_argument("--text", metavar="FILE", required=True, help="a UTF-8 text file to fit the scales on")
    p.add_argument("--window", type=int, default=256, help="tokens per window, each prefilled from an empty cache")
    p.add_argument("--max-tokens", type=int, default=None, help="fit on at most this many tokens of the text")
    p.add_argument("--out", metavar="FILE", default=None,
                   help=f"where to write (default: {kv_scales.FILE_NAME} in the model's directory, read at load)")
    p.add_argument("--force", action="store_true", help="replace a scales file calibrate-kv wrote before")
    add_model_options(p)
    p.set_defaults(run=run)


def run(args) -> int:
    model = demo_model_dir() if args.model == "demo" else args.model
    out = Path(args.out) if args.out else Path(model) / kv_scales.FILE_NAME
    check_out(out, force=args.force)
    path = Path(args.text)
    if not path.is_file():
        raise InputError(f"--text {args.text}: no such file")
    if args.layout == "auto":
        raise InputError("atoll calibrate-kv takes an explicit layout (--layout TP2 or -tp/-pp), not auto")
    llm = make_llm(args, model)
    if llm.tokenizer is None:
        raise InputError(f"{model} has no tokenizer.json: atoll calibrate-kv reads a text")
    wins = perplexity.windows(llm.tokenizer.encode(path.read_text(encoding="utf-8")), args.window, args.max_tokens)
    with llm:
        scales = fit(llm, wins, "text")
    how = {"by": "atoll calibrate-kv", "text": path.name, "tokens": len(wins) * args.window,
           "windows": len(wins), "window": args.window, "layout": str(llm.layout), "range": CALIBRATED_RANGE,
           "atoll": _version()}
    kv_scales.write_file(out, llm.config, scales, how)
    heads = kv_scales.cache_shape(llm.config)[0]
    print(f"wrote {out}: fp8 KV scales of {llm.config.num_hidden_layers} layers x {heads} kv heads from "
          f"{how['tokens']} tokens ({len(wins)} windows of {args.window}) of {path.name}")
    if args.out:
        print(f"runs read it with --kv-scales {out}")
    elif kv_scales.from_checkpoint(Checkpoint(model), llm.config) is not None:
        print("the checkpoint ships k_scale/v_scale of its own, which runs read first: pass --kv-scales "
              f"{out} to use these")
    return 0


def check_out(out: Path, *, force: bool) -> None:
    """Refuse to write over a file unless calibrate-kv wrote it and --force says to replace it."""
    if not out.exists():
        if not out.parent.is_dir():
            raise InputError(f"--out {out}: no directory {out.parent}")
        return
    if not kv_scales.written_by_calibrate(out):
        raise InputError(f"{out} exists and is not a scales file of atoll calibrate-kv: it is left alone "
                         f"(pass --out FILE to write elsewhere)")
    if not force:
        raise InputError(f"{out} exists (calibrate-kv wrote it): pass --force to replace it, or --out FILE")


def fit(llm, wins: list[list[int]], mode: str) -> kv_scales.ModelScales:
    """The whole model's scales from every rank's share (mode: engine/rank/kv_calibration.py's)."""
    layout = llm.layout
    if layout.dp != 1 or (layout.cp != 1 and mode == "text"):
        raise InputError(f"KV calibration runs one replica without context parallelism (got {layout})")
    if len(wins[0]) > llm.max_model_len:
        raise InputError(f"--window {len(wins[0])} exceeds the model's context of {llm.max_model_len} tokens")
    bs, batch = llm.options.block_size, min(len(wins), llm.max_num_seqs)
    spec = dataclasses.replace(llm.spec(), max_model_len=len(wins[0]))
    kv = dict(kv_cache_dtype="auto", kv_scales=None, calculate_kv_scales=False) if mode == "text" else \
        dict(kv_cache_dtype="fp8", kv_scales=None, calculate_kv_scales=True)
    spec = spec.with_engine(num_blocks=batch * -(-len(wins[0]) // bs), enforce_eager=True,
                            disable_hybrid_kv_cache_manager=True, kv_disk_dir=None, kv_shared=None,
                            kv_offload_gb=0.0, **kv)
    parts = llm.run(calibrate_worker, layout.world_size, spec, wins, mode, parallel=llm.context_options())
    return merge(parts, llm.config, f"{mode} fit")


def merge(parts: list[dict], config, source: str) -> kv_scales.ModelScales:
    """Every rank's layers and heads into [layers][kv_heads] (replicated heads agree: any one)."""
    heads, layers = kv_scales.cache_shape(config)[0], config.num_hidden_layers
    names = ("k", "v", "k_sink", "v_sink")
    out = {n: None if parts[0][n] is None else [[None] * heads for _ in range(layers)] for n in names}
    for p in parts:
        for j, layer in enumerate(p["layers"]):
            for i, h in enumerate(p["heads"]):
                for n in names:
                    if out[n] is not None:
                        out[n][layer][h] = p[n][j][i]
    missing = [(i, h) for i in range(layers) for h in range(heads) if out["k"][i][h] is None]
    assert not missing, f"no rank fitted layer/head {missing[0]}"
    return kv_scales.ModelScales(source, **out)


def fitted_scales_file(llm, wins: list[list[int]]) -> str:
    """`atoll eval perplexity --calculate-kv-scales`: the scales this run's first prefill would fit
    (the text's first window, prefilled by an fp8 cache fitting on its first store), in a
    temporary file the scoring reads through --kv-scales."""
    scales = fit(llm, wins, "first")
    f = tempfile.NamedTemporaryFile("w", suffix=".json", prefix="atoll-first-prefill-", delete=False)
    f.close()
    kv_scales.write_file(f.name, llm.config, scales, {"by": "--calculate-kv-scales on the first window"})
    print(f"atoll: fp8 KV scales fitted on the text's first window ({len(wins[0])} tokens), as a run's first "
          f"prefill would fit them", file=sys.stderr)
    return f.name



def _version() -> str:
    try:
        return importlib.metadata.version("atoll")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
