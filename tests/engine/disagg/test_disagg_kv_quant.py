"""A quantized KV cache over disaggregated prefill (engine.disagg.transfer): the prefill engine
sends its cache's 8-bit values and, for int8, their float32 scales as stored, and the decode
engine writes them into its own cache unchanged. Greedy tokens equal the colocated run's
with the same --kv-cache-dtype (whose prefill layout is the prefill engine's, so both decode
from the same cached bytes), and each request's kv_bytes_sent is the analytic figure for the
quantized cache: 1 byte a value (a quarter of the float32 cache), plus 4 bytes per token, head
and k/v for int8's scale; fp8 e4m3's fixed scales are not sent (both engines read the same
file at load: engine/disagg/transfer.py).

The runs batch their prompts as they come (the colocated engine prefills them together, the
prefill engine as its queue holds them): every prefill attends to the cache as stored
(layers/attention.py), so how the prompts were batched does not change their tokens."""

import pytest
from test_kv_scales import fit_scales

from atoll import LLM, SamplingParams
from atoll.engine.disagg.transfer import analytic_bytes
from atoll.layers.kv_quant import kv_format
from atoll.models import ModelConfig
from atoll.parallel.layout import Layout

PROMPTS = [[(7 * i + j) % 300 + 1 for j in range(5 + 6 * i)] for i in range(4)]  # 5 .. 23 tokens
NEW = 6
GREEDY = SamplingParams(max_tokens=NEW, ignore_eos=True)
FAMILIES = {"llama": ("llama", {}),
            "deepseek_v3": ("deepseek_v3", dict(num_hidden_layers=2))}  # MLA: the latent vector, one "head"


@pytest.mark.timeout(400)
@pytest.mark.parametrize("family,kv,decode", [("llama", "fp8", "TP1"), ("llama", "int8", "TP2"),
                                              ("llama", "fp8 calibrated", "TP2"), ("deepseek_v3", "int8", "TP1")])
def test_disaggregated_tokens_and_bytes_with_a_quantized_cache(tiny_model, tmp_path, family, kv, decode):
    kind, overrides = FAMILIES[family]
    model_dir = tiny_model(kind, **overrides)
    scales = {}
    if kv == "fp8 calibrated":  # scales and sinks both engines read from one file
        kv, scales = "fp8", dict(kv_scales=str(tmp_path / "scales.json"))
        fit_scales(model_dir, 6, scales["kv_scales"])
    with LLM(model_dir, layout="TP1", kv_cache_dtype=kv, block_size=4, **scales) as llm:
        colocated = llm.generate(PROMPTS, GREEDY, timeout_s=240)
    with LLM(model_dir, prefill="TP1", decode=decode, kv_cache_dtype=kv, block_size=8, **scales) as llm:
        outs = llm.generate(PROMPTS, GREEDY, timeout_s=240)
    assert [o.metrics["prefilled_on"] for o in outs] == ["prefill"] * len(PROMPTS)
    assert [o.token_ids for o in outs] == [o.token_ids for o in colocated]
    cfg, fmt, dst = ModelConfig.load(model_dir), kv_format(kv), Layout.parse(decode)
    sent = [o.metrics["kv_bytes_sent"] for o in outs]
    assert sent == [analytic_bytes(cfg, dst, len(p), fmt.itemsize, fmt.scale_bytes) for p in PROMPTS]
    fp32 = [analytic_bytes(cfg, dst, len(p), 4) for p in PROMPTS]
    values = [f // 4 for f in fp32]  # 1 byte a value
    if kv == "int8":  # plus a float32 scale per head_dim values
        dim = cfg.kv_lora_rank + cfg.qk_rope_head_dim if cfg.is_mla else cfg.head_dim
        assert sent == [v + v // dim * 4 for v in values]
    else:
        assert sent == values
