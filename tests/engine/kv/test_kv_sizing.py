"""KV cache sizing: the CUDA budget arithmetic, the CPU default from the requests, the line."""

import pytest

from atoll.engine.kv import sizing as kv
from atoll.errors import InputError

GIB = 1 << 30


def test_budget_is_what_remains_of_the_utilization():
    # 80 GiB GPU at 0.9 = 72 GiB; 16 GiB of weights and context, 4 GiB activation peak -> 52 GiB
    blocks = kv.budget_blocks(total=80 * GIB, utilization=0.9, used_after_load=16 * GIB,
                              activation_peak=4 * GIB, bytes_per_block=2 << 20)
    assert blocks == int(80 * GIB * 0.9 - 20 * GIB) // (2 << 20)


def test_budget_too_small_names_the_numbers():
    with pytest.raises(InputError, match="--gpu-memory-utilization 0.3 of 80.0 GiB"):
        kv.budget_blocks(total=80 * GIB, utilization=0.3, used_after_load=30 * GIB,
                         activation_peak=GIB, bytes_per_block=1 << 20)


def test_cpu_default_and_explicit():
    assert kv.cpu_blocks(block_size=16, max_num_seqs=4, max_model_len=33, lanes=2) == 4 * 3 * 2
    assert kv.explicit_blocks(bytes_per_block=1 << 20, kv_cache_gb=1.0, num_blocks=None) == 1024
    assert kv.explicit_blocks(bytes_per_block=1 << 20, kv_cache_gb=1.0, num_blocks=7) == 7
    assert kv.explicit_blocks(bytes_per_block=1 << 20, kv_cache_gb=None, num_blocks=None) is None
    with pytest.raises(InputError, match="max_model_len=64"):
        kv.check_fits(3, block_size=16, max_model_len=64)


def test_summary_line():
    line = kv.summary(100, block_size=16, bytes_per_block=1 << 20, max_model_len=320)
    assert line == ("KV cache: 100 blocks of 16 tokens (1600 tokens, 100.0 MiB per rank); "
                    "room for 5 sequences of max_model_len=320")
    assert "(16384 tokens, 2.00 GiB per rank)" in kv.summary(1024, block_size=16, bytes_per_block=2 << 20,
                                                               max_model_len=320)


def test_a_short_prompt_gets_a_small_cache(tiny_model):
    """The default CPU cache holds what the requests need, not max_num_seqs x the model's context."""
    from atoll.launch.api import LLM
    from atoll.engine.sample.sampler import SamplingParams

    llm = LLM(tiny_model("llama"), layout="PP2", device="cpu")  # context 256, 32 seqs per lane
    requests = llm.prepare([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=11))
    spec = llm.spec(requests)
    assert spec.max_model_len == 16 and spec.cache_seqs == 1
    assert llm.spec().max_model_len == 256 and llm.spec().cache_seqs is None
