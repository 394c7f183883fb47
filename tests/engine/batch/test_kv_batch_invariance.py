"""A prompt's greedy tokens do not depend on what else its steps hold, over every KV cache dtype
(layers/attention.py: every attention over a quantized cache reads the keys and values as
stored, the step's own new tokens included).

Eight prompts of 3 to 58 tokens run five ways: alone, one at a time; together; beside an
unrelated 900-token prompt; together with chunked prefill at a 64-token budget
(max_num_batched_tokens=64); and a second time from the prefix cache. The tokens must be the
same all five ways. Before the change a prompt prefilled alone (a batch of one length:
layers/prefill.py) attended over its own unquantized keys and one prefilled beside others over
the quantized cache: fp8 gave 6 of the 8 prompts the same tokens together as alone, fp8_e5m2
1 of 8 (int8 and the float cache 8 of 8).

Cases: every --kv-cache-dtype; fp8 with scales and sinks calibrated from a text (a file read
with --kv-scales) and fitted on the first prefill (--calculate-kv-scales: each
engine first runs the same warm-up prompt, so both fit the same scales). Then fp8 with
calibrated scales down each other path: TP2, PP2, CP2, MLA's latent cache (a tiny
DeepSeek-V3), speculative verify (n-gram drafts), the compiled CPU decode step and the Triton
kernels (on the CPU in Triton's interpreter: the prefill and decode kernels read the stored
bytes in place, and a prefill of one length takes the prefill kernel too). On a GPU the same
tests run the kernels compiled and the CUDA graph step (the default path there)."""

import pytest
from test_kv_scales import fit_scales

from atoll import LLM, SamplingParams

LENS = [3, 9, 14, 20, 27, 33, 41, 58]
PROMPTS = [[(31 * i + 7 * j) % 300 + 1 for j in range(n)] for i, n in enumerate(LENS)]
LONG = [(13 * j) % 297 + 2 for j in range(900)]  # the unrelated prompt
WARM = [[17, 4, 250, 9, 33, 101, 2, 76]]  # --calculate-kv-scales: every engine's first prefill
GREEDY = SamplingParams(max_tokens=16, ignore_eos=True)
WAYS = ("alone", "together", "beside 900", "chunked at 64", "prefix cache")


def five_ways(model_dir, layout: str = "TP1", *, prompts=PROMPTS, long=LONG, warm=None, **kw) -> dict[str, list]:
    """Each way's tokens for the prompts (one engine without prefix caching for the first three,
    one with a 64-token budget for the last two)."""
    runs = {}
    with LLM(str(model_dir), layout=layout, enable_prefix_caching=False, max_num_seqs=16, **kw) as llm:
        if warm:
            llm.generate(warm, GREEDY)
        runs["alone"] = [llm.generate([p], GREEDY)[0].token_ids for p in prompts]
        runs["together"] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        runs["beside 900"] = [o.token_ids for o in llm.generate(prompts + [long], GREEDY)][:len(prompts)]
    with LLM(str(model_dir), layout=layout, max_num_batched_tokens=64, max_num_seqs=16, **kw) as llm:
        if warm:
            llm.generate(warm, GREEDY)
        runs["chunked at 64"] = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        outs = llm.generate(prompts, GREEDY)
        runs["prefix cache"] = [o.token_ids for o in outs]
        assert sum(o.metrics["cached_tokens"] for o in outs) >= 16 * sum(len(p) // 16 for p in prompts)  # it hit
    return runs


def assert_same(runs: dict[str, list]) -> None:
    alone = runs["alone"]
    assert all(len(t) == GREEDY.max_tokens for t in alone)
    differ = {way: [i for i, (a, b) in enumerate(zip(alone, runs[way])) if a != b] for way in WAYS[1:]}
    assert not any(differ.values()), f"prompts whose tokens differ from alone: {differ}"


@pytest.fixture(scope="module")
def long_llama(tiny_model):
    return tiny_model("llama", max_position_embeddings=1024)


@pytest.fixture(scope="module")
def calibrated(long_llama, tmp_path_factory):
    """Scales fitted by atoll calibrate-kv's rank function on random tokens (sinks included)."""
    path = tmp_path_factory.mktemp("scales") / "scales.json"
    fit_scales(long_llama, 5, path)
    return str(path)


CASES = {"auto": {}, "int8": dict(kv_cache_dtype="int8"), "fp8_e5m2": dict(kv_cache_dtype="fp8_e5m2"),
         "fp8": dict(kv_cache_dtype="fp8"), "fp8 calibrated": "calibrated",
         "fp8 first prefill": dict(kv_cache_dtype="fp8", calculate_kv_scales=True, warm=WARM)}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", list(CASES))
def test_the_same_tokens_five_ways(long_llama, calibrated, case):
    kw = CASES[case]
    if kw == "calibrated":
        kw = dict(kv_cache_dtype="fp8", kv_scales=calibrated)
    assert_same(five_ways(long_llama, **kw))


PATHS = {"TP2": ("llama", "TP2", {}), "PP2": ("llama", "PP2", {}), "CP2": ("llama", "CP2", {}),
         "MLA": ("deepseek_v3", "TP1", {}),
         "spec verify": ("llama", "TP1", dict(speculative_config={"method": "ngram", "num_speculative_tokens": 3,
                                                                  "prompt_lookup_max": 3})),
         "compiled step": ("llama", "TP1", dict(compile="always")),
         "Triton kernels": ("llama", "TP1", dict(kernels="triton"))}  # on the CPU: Triton's interpreter


@pytest.mark.slow
@pytest.mark.timeout(400)
@pytest.mark.parametrize("path", list(PATHS))
def test_the_same_tokens_on_every_path(tiny_model, calibrated, tmp_path, path):
    """fp8 with calibrated scales (the tiny DeepSeek-V3's own: its latent cache is one head)."""
    kind, layout, kw = PATHS[path]
    model = tiny_model(kind, max_position_embeddings=1024)
    scales = calibrated if kind == "llama" else str(tmp_path / "scales.json")
    if kind != "llama":
        fit_scales(model, 5, scales)
    prompts, long = PROMPTS, LONG
    if path == "spec verify":  # prompts that repeat themselves, so the n-gram drafter proposes
        prompts = [(p[:4] * 20)[:len(p)] for p in PROMPTS]
    if path == "Triton kernels":  # the interpreter runs every program in numpy: fewer, shorter prompts
        prompts, long = PROMPTS[2::2], LONG[:300]
    assert_same(five_ways(model, layout, prompts=prompts, long=long, kv_cache_dtype="fp8", kv_scales=scales, **kw))
