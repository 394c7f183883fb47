"""Loading weights costs a rank about one slice of host memory, not its share of the model.

A ~240 MiB random Llama is saved as 4 safetensors shards; a fresh process per rank builds
its part of the model on the CPU and loads it while a thread samples its anonymous resident
memory (RssAnon: the safetensors mmap is page cache, not the rank's own memory). Two bounds:

- peak during the load - the loaded model <= the largest slice this rank reads + a fixed
  overhead: slices are read one at a time and copied into the parameters in place. On a GPU
  the parameters live on the device, so this bound is what limits host memory there. The
  loaded model is measured just before the load with the parameters already committed
  (zeroed), not after it: glibc keeps a freed slice buffer in its heap, so "after" can
  include the very transient it should be compared with.
- after the load - before building the model ~= this rank's parameter bytes: nothing read
  outlives the copy.
"""

import json

import pytest
from load_memory_fns import measure_load

from atoll.launch.local import run_local
from atoll.models.checkpoint import INDEX, Checkpoint

MiB = 2**20
OVERHEAD = 64 * MiB
SHARDS = 4
LLAMA = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=4,
             num_attention_heads=16, num_key_value_heads=4, max_position_embeddings=256,
             tie_word_embeddings=False)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def checkpoint_dir(tmp_path_factory):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**LLAMA)).to(torch.float32)
    out = tmp_path_factory.mktemp("llama-4-shards")
    # 247.5 MB in float32: embedding, 4 layers of ~45 MB and the LM head pack into 4 shards
    model.save_pretrained(out, max_shard_size=75 * 10**6)
    files = set(json.loads((out / INDEX).read_text())["weight_map"].values())
    assert len(files) == SHARDS, f"expected {SHARDS} shards, got {sorted(files)}"
    return out


def _largest_slice(model_dir, tp: int) -> int:
    """Bytes of the largest piece a tp rank reads: every 2-D Llama tensor is split by tp
    (vocab rows, heads or intermediate columns), the 1-D norms are replicated."""
    ckpt = Checkpoint(model_dir)
    largest = 0
    for name in ckpt.names():
        shape = ckpt.get(name).shape
        n = 4  # float32
        for s in shape:
            n *= s
        largest = max(largest, n // tp if len(shape) == 2 else n)
    return largest


def _check(fig: dict, largest_slice: int, what: str) -> None:
    transient = fig["peak"] - fig["start"]
    assert fig["largest_read"] <= largest_slice, f"{what}: handed a {fig['largest_read']} B slice"
    assert transient <= largest_slice + OVERHEAD, (
        f"{what}: peak during load is {transient / MiB:.1f} MiB above the loaded model; one slice is "
        f"{largest_slice / MiB:.1f} MiB and its parameters {fig['param_bytes'] / MiB:.1f} MiB")
    kept = fig["after"] - fig["before"]
    assert abs(kept - fig["param_bytes"]) <= 0.1 * fig["param_bytes"] + OVERHEAD, (
        f"{what}: the load left {kept / MiB:.1f} MiB for {fig['param_bytes'] / MiB:.1f} MiB of parameters")


def test_peak_host_memory_is_one_slice(checkpoint_dir):
    (tp1,) = run_local(measure_load, 1, str(checkpoint_dir), timeout_s=120)
    tp2 = run_local(measure_load, 2, str(checkpoint_dir), timeout_s=120)
    one, half = _largest_slice(checkpoint_dir, 1), _largest_slice(checkpoint_dir, 2)
    # the bound must tell one slice from a rank's share, or the test shows nothing
    assert half + OVERHEAD < tp2[1]["param_bytes"] and one + OVERHEAD < tp1["param_bytes"]
    _check(tp1, one, "tp1")
    for rank, fig in enumerate(tp2):
        _check(fig, half, f"tp2 rank {rank}")
    share = tp2[1]["bytes_read"] / tp1["bytes_read"]
    assert 0.49 < share < 0.51, f"tp2 rank 1 read {share:.3f} of what tp1 read"
