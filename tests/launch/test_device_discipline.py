"""Device discipline: a whole generate run (TP2PP2 dense, DP2EP2 MoE) with torch's default
device set to `meta` in every rank and device="cpu" passed explicitly. A tensor created
without the rank's device would be a meta tensor and fail; the tokens must still be
transformers' own."""

import pytest
from device_fns import generate_on_meta_default
from reference import reference_tokens

from atoll.launch.api import LLM
from atoll.engine.sample.sampler import SamplingParams
from atoll.launch.local import run_local

PROMPTS = [[5, 7, 9, 11], [100, 3], [42, 8, 1, 2, 3, 4, 5], [77]]
NEW = 8


@pytest.mark.timeout(400)
@pytest.mark.parametrize("kind,layout", [("llama", "TP2PP2"), ("qwen3_moe", "DP2EP2")])
def test_generate_names_the_device_everywhere(tiny_model, kind, layout):
    d = tiny_model(kind)
    llm = LLM(d, layout=layout, device="cpu", block_size=4, max_num_seqs=2)  # 2: preemption-free batching
    requests = llm.prepare(PROMPTS, SamplingParams(max_tokens=NEW, ignore_eos=True))
    spec = llm.spec(requests)
    out = run_local(generate_on_meta_default, llm.layout.world_size, spec, requests, device="cpu",
                    timeout_s=350)
    assert all(o["default"] == "meta" and o["device"] == "cpu" for o in out)  # the trap was set
    got = [r["token_ids"] for r in out[0]["results"]]
    assert got == reference_tokens(d, PROMPTS, NEW)


def test_meta_default_catches_a_tensor_without_device():
    """The trap works: a tensor made without a device is meta, and reading it fails."""
    import torch

    torch.set_default_device("meta")
    try:
        ids = torch.tensor([1, 2, 3])  # what the step metadata was built with before
        assert ids.device.type == "meta"
        with pytest.raises(NotImplementedError):
            ids.tolist()
        with pytest.raises(RuntimeError):
            torch.zeros(2, device="cpu") + ids
    finally:
        torch.set_default_device(None)
