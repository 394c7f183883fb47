"""fp8 e4m3's fixed KV scales and first-position sinks (layers/kv_quant.py, models/kv_scales.py):
powers of two read back exactly, a sink subtracted from position 0 on writing and added back on
every read (the torch paths, the kernels' references, a fresh prefill's read-back), the fit on
the first store and its agreement over the ranks that must agree (TP ranks hold their own heads,
CP ranks share one fit), the checkpoint's k_scale/v_scale under vLLM's and ModelOpt's names,
`atoll calibrate-kv`'s file (written beside the checkpoint, never over a file by surprise, read
at load), and the refusals."""

import json

import pytest
import torch
import torch.nn.functional as F
from cli import run_cli
from safetensors.torch import load_file, save_file
from serving import with_tokenizer, words

from atoll import LLM, SamplingParams
from atoll.cli.calibrate_kv import fit
from atoll.config import EngineConfig
from atoll.engine.driver.perplexity import windows
from atoll.errors import CheckpointError, InputError
from atoll.kernels import reference
from atoll.layers.attention import AttentionMetadata, attend, gather_blocks, write_cache
from atoll.layers.kv_quant import (FIRST_PREFILL_RANGE, QuantizedKV, dequantize, fit_scale, kv_format,
                                   power_of_two_above, quantize, static_digest)
from atoll.layers.prefill import fresh_prefill
from atoll.models import ModelConfig, kv_scales
from atoll.models.checkpoint import Checkpoint

E4M3 = kv_format("fp8")


def fit_scales(model_dir, seed: int, out, *, layout: str = "TP1", mode: str = "text") -> kv_scales.ModelScales:
    """atoll calibrate-kv's fit over 17 windows of 64 random tokens (seed), written to `out` (None: not written)."""
    ids = torch.randint(0, 301, (17 * 64,), generator=torch.Generator().manual_seed(seed)).tolist()
    with LLM(str(model_dir), layout=layout, max_num_seqs=4) as llm:
        scales = fit(llm, windows(ids, 64), mode)
        if out is not None:
            kv_scales.write_file(out, llm.config, scales, {"by": "tests"})
    return scales


# --- scales and sinks ---

def test_scales_are_powers_of_two_read_back_exactly():
    x = torch.tensor([1.0, 0.75, 3e-3, 448.0, 2.0**-20])
    assert power_of_two_above(x).tolist() == [1.0, 1.0, 2.0**-8, 512.0, 2.0**-20]
    assert fit_scale(torch.tensor([3.5, 0.0]), 224.0).tolist() == [2.0**-6, 1.0]  # no value: 1
    g = torch.Generator().manual_seed(0)
    x = torch.randn(64, 2, 32, generator=g) * torch.tensor([0.05, 30.0])[:, None]
    scale = torch.tensor([2.0**-8, 2.0**-1])
    q, none = quantize(x, E4M3, scale)
    assert none is None
    back = dequantize(q, scale, torch.float32)
    err = (back - x).abs()
    assert (err <= 2**-4 * x.abs() + 2**-9 * scale[:, None]).all()  # e4m3's 1/16, subnormals absolute
    # a power of two: the value read back is exact in bf16 too, so every path reads the same key
    assert torch.equal(dequantize(q, scale, torch.bfloat16).float(), back)


def _sink_caches(sink_scale=3.0):
    """Two e4m3 caches (k, v) of 6 blocks of 4, 2 kv heads of 8, with scales and random sinks."""
    g = torch.Generator().manual_seed(1)
    caches = []
    for role in ("k", "v"):
        c = QuantizedKV((6, 4, 2, 8), E4M3, torch.float32, role=role)
        c.set_static([2.0**-2, 2.0**-4], torch.randn(2, 8, generator=g) * sink_scale)
        caches.append(c)
    return caches


def test_the_sink_is_added_back_on_every_read():
    """Position 0 is stored minus the sink: a first token near the sink is read back nearly
    exactly (the attention sink's key, which 1/16 of would move every query), and every path
    reads the same values: the store's read-back (a fresh prefill), gather_blocks (attend), the
    kernels' torch reference; a later chunk over the cached prompt attends as one step would."""
    kc, vc = _sink_caches()
    g = torch.Generator().manual_seed(2)
    lens = [7, 5]
    k, v = (torch.randn(12, 2, 8, generator=g) for _ in range(2))
    k[0], k[7] = kc.sink + 0.01, kc.sink - 0.02  # the two sequences' first tokens, near the sink
    q = torch.randn(12, 4, 8, generator=g)
    meta = AttentionMetadata.build([[0, 1], [2, 3]], [0, 0], lens, 4)
    kb, vb = write_cache(kc, vc, k, v, meta)
    assert (kb[[0, 7]] - k[[0, 7]]).abs().max() < 2e-3  # 1/16 of 0.02, not of the sink's 3
    assert (kb - k).abs().max() > 0.05  # the others round as e4m3 does
    gathered = gather_blocks(kc, meta.block_tables).transpose(1, 2)  # [2, 8 keys, 2, 8]
    assert torch.equal(gathered[0, :7], kb[:7]) and torch.equal(gathered[1, :5], kb[7:])
    want = attend(q, kc, vc, meta)  # gathers the blocks
    ref = reference.paged_prefill_attention(q, kc.data, vc.data, meta.block_tables, meta.query_starts(), meta.starts,
                                            k_scale=kc.kernel_scale(), v_scale=vc.kernel_scale(), k_sink=kc.sink,
                                            v_sink=vc.sink)
    torch.testing.assert_close(ref, want, atol=1e-6, rtol=1e-6)
    one = AttentionMetadata.build([[0, 1]], [0], [7], 4)  # the first prompt alone: a fresh prefill
    torch.testing.assert_close(fresh_prefill(q[:7], kb[:7], vb[:7], one), want[:7], atol=1e-6, rtol=1e-6)
    chunk = AttentionMetadata.build([[0, 1]], [4], [3], 4)  # its last 3 tokens over the 4 cached
    torch.testing.assert_close(attend(q[4:7], kc, vc, chunk), want[4:7], atol=1e-6, rtol=1e-6)


def test_the_first_store_fits_the_scales():
    """--calculate-kv-scales: a scale is the largest |x| of the head over 200 (keys) or 100
    (values), rounded up to a power of two (vLLM's constants), the sink the mean of the rows at
    position 0; later stores keep them; an empty store (an idle replica) fits nothing; a cp
    group's shares fit as one."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(20, 2, 8, generator=g) * 4
    first = torch.zeros(20, dtype=torch.bool)
    first[[0, 9]] = True
    k, v = (QuantizedKV((4, 8, 2, 8), E4M3, torch.float32, role=r) for r in ("k", "v"))
    k.pending = v.pending = True
    at = torch.zeros(0, dtype=torch.long)
    k.store(at, at, x[:0], first=first[:0])
    assert k.pending
    block, offset = torch.arange(20) // 8, torch.arange(20) % 8
    back = k.store(block, offset, x, first=first, read_back=True)
    v.store(block, offset, x, first=first)
    torch.testing.assert_close(k.sink, x[[0, 9]].mean(0))
    assert k.head_scale.tolist() == fit_scale(x.abs().amax(dim=(0, 2)), FIRST_PREFILL_RANGE["k"]).tolist()
    assert v.head_scale.tolist() == fit_scale(x.abs().amax(dim=(0, 2)), 100.0).tolist()
    assert not k.pending and (back - x).abs().max() < 2**-4 * x.abs().max()
    sink = k.sink.clone()
    k.store(block, offset, x * 50, first=first)
    assert torch.equal(k.sink, sink)  # fitted once
    # two cp ranks, each with half of the tokens, agree on the fit of all of them (maxima and sums)
    other, other_first = x[10:], first[10:]

    def agree(t, op):
        if op == "max":
            return torch.maximum(t, other.abs().amax(dim=(0, 2)))
        return t + torch.cat([other[other_first].sum(0).reshape(-1), torch.tensor([1.0 * other_first.sum(), 10.0])])

    shared = QuantizedKV((4, 8, 2, 8), E4M3, torch.float32, role="k")
    shared.pending = True
    shared.store(block[:10], offset[:10], x[:10], first=first[:10], agree=agree)
    torch.testing.assert_close(shared.sink, sink)
    assert torch.equal(shared.head_scale, k.head_scale)


def test_the_tiers_namespace_sees_the_scales():
    a, b = (QuantizedKV((2, 4, 2, 8), E4M3, torch.float32) for _ in range(2))
    assert static_digest([a]) == static_digest([b]) != ""
    b.set_static([0.5, 1.0])
    assert static_digest([a]) != static_digest([b])
    b.pending = True
    assert static_digest([b]) == "pending" and static_digest([torch.zeros(1)]) == ""


# --- sources: the checkpoint, the file, calibrate-kv ---

def _with_scales(model_dir, out, names: dict) -> str:
    """A copy of a tiny checkpoint with extra tensors `names` (name -> tensor) in its safetensors."""
    import shutil

    shutil.copytree(model_dir, out)
    tensors = load_file(str(out / "model.safetensors"))
    save_file({**tensors, **names}, str(out / "model.safetensors"), metadata={"format": "pt"})
    return str(out)


@pytest.mark.timeout(300)
def test_checkpoint_k_scale_and_v_scale_are_read(tiny_model, tmp_path, capfd):
    """vLLM's names (one scale per tensor), ModelOpt's (k_proj.k_scale), the deprecated kv_scale
    (k and v alike) and one per kv head; strict loading takes them (no parameter reads them) and
    a run reads them, rounded up to powers of two."""
    base = tiny_model("llama")
    config = ModelConfig.load(base)
    vllm = {f"model.layers.{i}.self_attn.{w}_scale": torch.tensor(0.01 * (i + 1)) for i in range(3) for w in "kv"}
    got = kv_scales.from_checkpoint(Checkpoint(_with_scales(base, tmp_path / "vllm", vllm)), config)
    assert got.k == [[torch.tensor(0.01 * (i + 1)).item()] * 2 for i in range(3)] and got.v == got.k
    assert got.k_sink is None and got.v_sink is None
    modelopt = {f"model.layers.{i}.self_attn.{w}_proj.{w}_scale": torch.tensor([0.5, 0.25]) for i in range(3)
                for w in "kv"}
    legacy = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor([0.125]) for i in range(3)}
    for name, extra in (("modelopt", modelopt), ("legacy", legacy)):
        got = kv_scales.from_checkpoint(Checkpoint(_with_scales(base, tmp_path / name, extra)), config)
        want = [0.5, 0.25] if name == "modelopt" else [0.125, 0.125]
        assert got.k == [want] * 3 and got.v == [want] * 3, name
    bad = {"model.layers.0.self_attn.k_scale": torch.ones(3)}
    with pytest.raises(CheckpointError, match="has 3 values; a KV scale is one per tensor or one per kv head"):
        kv_scales.from_checkpoint(Checkpoint(_with_scales(base, tmp_path / "bad", bad)), config)
    with pytest.raises(CheckpointError, match="no k_scale of layer 1"):
        kv_scales.from_checkpoint(Checkpoint(_with_scales(base, tmp_path / "some", dict(list(vllm.items())[:2]))),
                                  config)
    with LLM(str(tmp_path / "vllm"), kv_cache_dtype="fp8", num_blocks=16) as llm:
        outs = llm.generate([[5, 7, 9]], SamplingParams(max_tokens=4, ignore_eos=True))
    assert len(outs[0].token_ids) == 4
    assert "fp8 KV cache scales from the checkpoint's k_scale/v_scale" in capfd.readouterr().err
    assert kv_scales.rank_heads(config, 4, 3) == [1] and kv_scales.rank_heads(config, 2, 1) == [1]


def test_the_file_is_checked_against_the_model(tiny_model, tmp_path):
    config = ModelConfig.load(tiny_model("llama"))
    sink = [[[0.5] * 16, [-0.5] * 16]] * 3
    scales = kv_scales.ModelScales("t", [[0.5, 1.0]] * 3, [[0.25, 0.25]] * 3, sink, sink)
    path = tmp_path / kv_scales.FILE_NAME
    kv_scales.write_file(path, config, scales, {"by": "tests"})
    back = kv_scales.read_file(path, config)
    assert (back.k, back.v, back.k_sink, back.v_sink) == (scales.k, scales.v, sink, sink)
    assert back.for_rank(range(1, 3), [1]) == [([1.0], [0.25], [[-0.5] * 16], [[-0.5] * 16])] * 2
    raw = json.loads(path.read_text())
    raw["num_hidden_layers"] = 4
    path.write_text(json.dumps(raw))
    with pytest.raises(InputError, match="was calibrated for num_hidden_layers=4, the model has 3"):
        kv_scales.read_file(path, config)
    path.write_text("{}")
    with pytest.raises(InputError, match="is not a KV scales file of atoll calibrate-kv"):
        kv_scales.read_file(path, config)


@pytest.mark.timeout(300)
def test_calibrate_kv_writes_beside_the_checkpoint_and_runs_read_it(tiny_model, tmp_path, capfd):
    model = with_tokenizer(tiny_model("llama"), tmp_path / "m")
    text = tmp_path / "text.txt"
    text.write_text(" ".join(words(301)[(7 * i) % 290 + 5] for i in range(700)))
    argv = ["calibrate-kv", "--model", model, "--text", text, "--window", 64]
    code, out, _ = run_cli(capfd, *argv)
    beside = model / kv_scales.FILE_NAME
    assert code == 0 and f"wrote {beside}: fp8 KV scales of 3 layers x 2 kv heads from 640 tokens" in out
    written = kv_scales.read_file(beside, ModelConfig.load(model))
    assert all(s == 2.0 ** round(torch.tensor(s).log2().item()) for row in written.k + written.v for s in row)
    code, _, err = run_cli(capfd, *argv)  # never over a file by surprise
    assert code == 2 and "exists (calibrate-kv wrote it): pass --force to replace it" in err
    assert run_cli(capfd, *argv, "--force")[0] == 0
    mine = tmp_path / "mine.json"
    mine.write_text('{"a user": "file"}')
    code, _, err = run_cli(capfd, *argv, "--out", mine)
    assert code == 2 and "is not a scales file of atoll calibrate-kv: it is left alone" in err
    assert mine.read_text() == '{"a user": "file"}'
    capfd.readouterr()
    with LLM(str(model), kv_cache_dtype="fp8", num_blocks=16) as llm:
        llm.generate([[5, 7, 9]], SamplingParams(max_tokens=2, ignore_eos=True))
    assert f"fp8 KV cache scales from {beside}" in capfd.readouterr().err


@pytest.mark.timeout(300)
def test_the_ranks_fit_what_one_rank_fits(tiny_model):
    """calibrate-kv at TP2 and PP2 puts every rank's heads and layers where TP1 has them; the
    first-prefill fit at TP2 (each rank its own heads) and at CP2 (the cp ranks' shares agreed
    into one fit) is TP1's: the same scales, the sinks to float noise."""
    model = tiny_model("llama")
    one = fit_scales(model, 4, None)
    for layout in ("TP2", "PP2"):
        other = fit_scales(model, 4, None, layout=layout)
        assert other.k == one.k and other.v == one.v, layout
        for a, b in ((other.k_sink, one.k_sink), (other.v_sink, one.v_sink)):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)
    first = fit_scales(model, 4, None, mode="first")
    for layout in ("TP2", "CP2"):
        other = fit_scales(model, 4, None, layout=layout, mode="first")
        assert other.k == first.k and other.v == first.v, layout
        for a, b in ((other.k_sink, first.k_sink), (other.v_sink, first.v_sink)):
            torch.testing.assert_close(torch.tensor(a), torch.tensor(b), atol=1e-5, rtol=1e-5)
    assert first.k_sink != one.k_sink  # one window's first token against the mean of 17


def test_refusals(tmp_path):
    with pytest.raises(InputError, match="give --kv-scales or --calculate-kv-scales, not both"):
        EngineConfig(kv_cache_dtype="fp8", kv_scales=__file__, calculate_kv_scales=True)
    with pytest.raises(InputError, match="--calculate-kv-scales sets fp8 e4m3's scales: it needs --kv-cache-dtype "
                                         "fp8, not int8"):
        EngineConfig(kv_cache_dtype="int8", calculate_kv_scales=True)
    with pytest.raises(InputError, match="--kv-scales .*missing.json: no such file"):
        EngineConfig(kv_cache_dtype="fp8", kv_scales=str(tmp_path / "missing.json"))
    with pytest.raises(InputError, match="--calculate-kv-scales with --prefill/--decode: the decode engine"):
        EngineConfig(kv_cache_dtype="fp8", calculate_kv_scales=True, prefill="TP1", decode="TP1")
    with pytest.raises(InputError, match="--calculate-kv-scales with --kv-disk-dir/--kv-shared"):
        EngineConfig(kv_cache_dtype="fp8", calculate_kv_scales=True, kv_disk_dir=str(tmp_path))
    assert EngineConfig(kv_cache_dtype="fp8", kv_scales=__file__, prefill="TP1", decode="TP1").kv_scales == __file__


@pytest.mark.timeout(400)
def test_a_first_prefill_fit_under_the_compiled_decode_step(tiny_model):
    """--calculate-kv-scales with the CPU's compiled decode step: the step's warm-up (scratch
    rows, before any prompt) must not fit the scales, nor trace the fit (it branches on data);
    the prompt fits them and the compiled steps give the eager steps' tokens."""
    d = tiny_model("llama")
    prompts = [[5, 7, 9, 11, 13, 2, 8], [100, 3, 4]]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    runs = []
    for compile_ in ("never", "always"):
        with LLM(str(d), kv_cache_dtype="fp8", calculate_kv_scales=True, compile=compile_) as llm:
            runs.append([o.token_ids for o in llm.generate(prompts, params)])
    assert runs[0] == runs[1] and all(len(t) == 12 for t in runs[0])
