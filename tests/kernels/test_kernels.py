"""Kernel dispatch, rms_norm and rotary: the Triton kernels against their torch references.

On a machine without a GPU the Triton path runs in Triton's interpreter. The interpreter must
be chosen before triton is first imported in the process, so this module sets
TRITON_INTERPRET=1 while pytest collects it (before any test runs). If something imported
triton earlier, the in-process tests skip and test_kernels_in_fresh_process reruns this file
in a child with the variable set from the start. On a GPU the kernels run compiled.
"""

import os
import subprocess
import sys
import types

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU and "triton" not in sys.modules:
    os.environ["TRITON_INTERPRET"] = "1"  # must precede triton's first import in this process
pytest.importorskip("triton", reason="triton is not installed (pip install triton): the kernel tests run "
                                     "its kernels, in its interpreter on CPU")

from atoll import kernels  # noqa: E402
from atoll.kernels import backend, reference  # noqa: E402
from atoll.kernels.backend import KernelError  # noqa: E402
from atoll.config import resolve  # noqa: E402
from atoll.errors import InputError  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
IN_PROCESS = ON_GPU or backend.triton_interpreted() is not False
DTYPES = [torch.float32, torch.bfloat16]
# error bound per dtype, as a fraction of the reference's largest magnitude. float32: sums in
# another order. bfloat16: two ulps; the kernels round once from float32 while the layer math
# rounds after every op, and the interpreter rounds to bf16 by truncation, not to nearest.
TOL = {torch.float32: 2e-5, torch.bfloat16: 2**-6}


def assert_close(out: torch.Tensor, ref: torch.Tensor, tol: float | None = None) -> None:
    tol = TOL[ref.dtype] if tol is None else tol
    assert out.dtype == ref.dtype and out.shape == ref.shape
    scale = ref.float().abs().max().item() or 1.0
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol * scale)


class _NoReference:
    def __getattr__(self, name):
        raise AssertionError(f"reference.{name} ran on the forced Triton path")


@pytest.fixture
def triton_path(monkeypatch):
    """Kernel calls in the test take the Triton path (compiled on a GPU, interpreted on CPU);
    the dispatchers' reference is replaced by a stub that fails if called."""
    if not IN_PROCESS:
        pytest.skip("triton was imported compiled before this module; test_kernels_in_fresh_process reruns it")
    monkeypatch.setattr("atoll.kernels.ops.reference", _NoReference())
    monkeypatch.setattr("atoll.kernels.moe.reference", _NoReference())
    if ON_GPU:
        with backend.using("triton"):
            yield
    else:
        with backend.interpreter():
            yield


@pytest.mark.skipif(IN_PROCESS, reason="triton's interpreter is usable in this process")
@pytest.mark.timeout(600)
def test_kernels_in_fresh_process():
    files = [f for f in os.listdir(os.path.dirname(__file__)) if f.startswith("test_kernels")]
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *files],
                       cwd=os.path.dirname(__file__), env=env, capture_output=True, text=True, timeout=590)
    assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]


# --- dispatch ---

def test_import_does_not_import_triton():
    code = "import sys, atoll, atoll.kernels; assert 'triton' not in sys.modules, 'triton imported'"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_auto_picks_reference_on_cpu_and_triton_on_cuda():
    assert backend.mode() == "auto"
    assert not backend.use_triton(torch.ones(2))
    fake_cuda = types.SimpleNamespace(is_cuda=True)
    assert backend.use_triton(fake_cuda)
    assert not backend.use_triton(fake_cuda, torch.ones(2))  # any CPU tensor: reference


def test_mode_torch_forces_reference():
    with backend.using("torch"):
        assert not backend.use_triton(types.SimpleNamespace(is_cuda=True))
    assert backend.mode() == "auto" and backend.use_triton(types.SimpleNamespace(is_cuda=True))


def test_bad_env_value_and_cpu_without_interpreter_are_clear_errors(monkeypatch):
    with pytest.raises(KernelError, match="kernels='cuda' is not one of auto, torch, triton"):
        with backend.using("cuda"):
            pass
    with pytest.raises(InputError, match="kernels 'cuda' is not one of auto, torch, triton"):
        resolve(environ={"ATOLL_KERNELS": "cuda"})
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with backend.using("triton"), pytest.raises(KernelError, match="needs TRITON_INTERPRET=1"):
        backend.use_triton(torch.ones(1))


def test_interpreter_reloads_a_kernel_module_built_compiled(monkeypatch):
    if not IN_PROCESS or ON_GPU:
        pytest.skip("checks the interpreter switch on CPU")
    import atoll.kernels.triton_rms_norm as mod

    monkeypatch.setattr(mod, "INTERPRETED", False)  # as if imported without TRITON_INTERPRET
    with backend.interpreter():
        assert mod.INTERPRETED is True
        assert type(mod._rms_norm_kernel).__name__ == "InterpretedFunction"


def test_input_errors_name_the_numbers():
    x = torch.randn(3, 8)
    with pytest.raises(KernelError, match=r"weight must be \[8\], got \(7,\)"):
        kernels.rms_norm(x, torch.ones(7), 1e-6)
    with pytest.raises(KernelError, match=r"w2 must be \[experts=2, hidden=8, inter=4\], got \(2, 8, 5\)"):
        kernels.fused_moe(x, torch.randn(2, 8, 8), torch.randn(2, 8, 5), torch.zeros(3, 1, dtype=torch.long),
                          torch.ones(3, 1))


# --- rms_norm ---

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [(1, 64), (7, 100), (2, 3, 96)], ids=str)
@pytest.mark.parametrize("with_residual", [False, True], ids=["plain", "residual"])
def test_rms_norm(triton_path, dtype, shape, with_residual):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(shape, generator=g).to(DEVICE, dtype)
    weight = (1 + 0.1 * torch.randn(shape[-1], generator=g)).to(DEVICE, dtype)
    res = torch.randn(shape, generator=g).to(DEVICE, dtype) if with_residual else None
    res_ref = res.clone() if with_residual else None
    out = kernels.rms_norm(x, weight, 1e-6, residual=res)
    want = reference.rms_norm(x, weight, 1e-6, residual=res_ref)
    assert_close(out, want)
    if with_residual:
        assert_close(res, res_ref)  # the sum x + residual, written in place


def test_rms_norm_eps_counts(triton_path):
    x = 1e-2 * torch.randn(4, 64).to(DEVICE)  # mean square ~1e-4: eps=1e-3 changes the result
    weight = torch.ones(64, device=DEVICE)
    out = kernels.rms_norm(x, weight, 1e-3)
    assert_close(out, reference.rms_norm(x, weight, 1e-3))
    assert not torch.allclose(out, reference.rms_norm(x, weight, 1e-6), rtol=1e-2)


def test_rms_norm_weight_dtype_promotes_like_the_layer(triton_path):
    x = torch.randn(5, 48).to(DEVICE, torch.bfloat16)
    weight = torch.rand(48, device=DEVICE) + 0.5  # float32 weight on bf16 activations
    out = kernels.rms_norm(x, weight, 1e-5)
    assert out.dtype == torch.float32
    assert_close(out, reference.rms_norm(x, weight, 1e-5), tol=TOL[torch.bfloat16])  # x.to(bf16) rounds first


def test_rms_norm_reference_is_the_layer():
    """On CPU (where the layer takes the torch path) the layer and the reference agree exactly."""
    from atoll.layers.norm import RMSNorm

    layer = RMSNorm(40, eps=1e-5, dtype=torch.bfloat16)
    layer.weight.data.uniform_(0.5, 1.5)
    x = torch.randn(6, 40, dtype=torch.bfloat16)
    want = layer(x.clone())
    assert torch.equal(reference.rms_norm(x, layer.weight.data, 1e-5), want)


# --- rotary ---

def _rope(tokens, dim, dtype, device=DEVICE):
    from atoll.layers.rotary import RotaryEmbedding

    rope = RotaryEmbedding(dim, 10000.0).to(device)
    positions = torch.arange(3, 3 + tokens, device=device) * 7
    return rope, positions, rope.cos_sin(positions, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens,heads,kv_heads,dim", [(1, 4, 1, 16), (5, 6, 2, 64), (3, 5, 5, 24)])
def test_rotary_in_place(triton_path, dtype, tokens, heads, kv_heads, dim):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(tokens, heads, dim, generator=g).to(DEVICE, dtype)
    k = torch.randn(tokens, kv_heads, dim, generator=g).to(DEVICE, dtype)
    _, _, (cos, sin) = _rope(tokens, dim, dtype)
    q_ref, k_ref = q.clone(), k.clone()
    reference.rotary_(q_ref, k_ref, cos, sin)
    assert kernels.rotary_(q, k, cos, sin) is None
    assert_close(q, q_ref)
    assert_close(k, k_ref)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rotary_on_views_of_a_fused_qkv(triton_path, dtype):
    """q and k as strided views of one qkv output, rotating only the rope part of each head
    (the DeepSeek layout); the rest of qkv, v included, must not change."""
    tokens, heads, kv_heads, dim, rope_dim = 3, 4, 2, 24, 16
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim).to(DEVICE, dtype)
    before = qkv.clone()
    q = qkv[:, : heads * dim].view(tokens, heads, dim)[..., dim - rope_dim:]
    k = qkv[:, heads * dim: (heads + kv_heads) * dim].view(tokens, kv_heads, dim)[..., dim - rope_dim:]
    _, _, (cos, sin) = _rope(tokens, rope_dim, dtype)
    q_ref, k_ref = q.clone(), k.clone()
    reference.rotary_(q_ref, k_ref, cos, sin)
    kernels.rotary_(q, k, cos, sin)
    assert_close(q, q_ref)
    assert_close(k, k_ref)
    untouched = torch.ones_like(qkv, dtype=torch.bool)
    untouched.view(tokens, -1, dim)[: , : heads + kv_heads, dim - rope_dim:] = False
    assert torch.equal(qkv[untouched], before[untouched])


def test_rotary_reference_is_the_layer():
    """On CPU (where the layer takes the torch path) the layer and the reference agree exactly."""
    rope, positions, (cos, sin) = _rope(4, 32, torch.float32, device="cpu")
    q, k = torch.randn(4, 3, 32), torch.randn(4, 1, 32)
    want_q, want_k = rope(q.clone(), k.clone(), positions)  # clones: the layer may rotate in place
    reference.rotary_(q, k, cos, sin)
    assert torch.equal(q, want_q) and torch.equal(k, want_k)


def _adjacent_tensors(tokens, heads, kv_heads, dim, dtype):
    """q and k as two tensors of their own whose memory lies end to end (as a caching allocator
    may place two allocations): two storages, k's first byte right after q's last."""
    el = torch.finfo(dtype).bits // 8
    q_bytes, k_bytes = tokens * heads * dim * el, tokens * kv_heads * dim * el
    mem = memoryview(bytearray(q_bytes + k_bytes))
    q = torch.frombuffer(mem[:q_bytes], dtype=dtype).view(tokens, heads, dim)
    k = torch.frombuffer(mem[q_bytes:], dtype=dtype).view(tokens, kv_heads, dim)
    assert k.data_ptr() == q.data_ptr() + q_bytes  # the layout that fooled a data_ptr test
    return q, k


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("tokens", [1, 5])
@pytest.mark.parametrize("layout", ["separate", "adjacent", "qkv"])
def test_rotary_reference_on_separate_and_fused_q_k_is_the_formula(dtype, tokens, layout):
    """reference.rotary_ rotates q and k as one view only when they are views of one buffer
    (k's heads right after q's); separate tensors, even end to end in memory, are rotated one by
    one. Either way the result is q*cos + rotate_half(q)*sin, bit for bit (the bench's rotary
    row crashed on separate q, k at T=1 that a data_ptr test took for one buffer)."""
    from atoll.kernels.reference import _joined

    heads, kv_heads, dim = 32, 8, 128
    g = torch.Generator().manual_seed(2)
    if layout == "qkv":
        qkv = torch.randn(tokens, (heads + 2 * kv_heads) * dim, generator=g).to(dtype)
        q, k, v = (x.view(tokens, -1, dim) for x in qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=-1))
        v_in = v.clone()
    else:
        if layout == "adjacent":
            q, k = _adjacent_tensors(tokens, heads, kv_heads, dim, dtype)
        else:
            q, k = torch.empty(tokens, heads, dim, dtype=dtype), torch.empty(tokens, kv_heads, dim, dtype=dtype)
        q.copy_(torch.randn(q.shape, generator=g))
        k.copy_(torch.randn(k.shape, generator=g))
    assert len(_joined(q, k)) == (1 if layout == "qkv" else 2)
    cos, sin = torch.randn(tokens, dim, generator=g).to(dtype), torch.randn(tokens, dim, generator=g).to(dtype)
    q_in, k_in = q.clone(), k.clone()
    reference.rotary_(q, k, cos, sin)
    half = dim // 2
    c, s = cos[:, None], sin[:, None]
    rotate_half = lambda x: torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # noqa: E731
    assert torch.equal(q, q_in * c + rotate_half(q_in) * s)
    assert torch.equal(k, k_in * c + rotate_half(k_in) * s)
    if layout == "qkv":
        assert torch.equal(v, v_in)


def test_joined_needs_one_storage_in_bounds():
    """_joined's exact test: views of one buffer whose joined view would run past the storage,
    or whose strides differ, are not joined."""
    from atoll.kernels.reference import _joined

    buf = torch.zeros(1, (4 + 2) * 8)
    q, k = buf[:, :32].view(1, 4, 8), buf[:, 32:].view(1, 2, 8)
    assert len(_joined(q, k)) == 1
    assert len(_joined(q, k[:, :1])) == 1  # fewer kv heads: still inside the storage
    assert len(_joined(q[:, :3], k)) == 2  # k does not start where q's heads end
    wide = torch.zeros(3, 2 * (4 + 2) * 8)  # rows of different strides
    q2 = wide[:, :32].view(3, 4, 8)
    k2 = wide[:, 32:48].view(3, 2, 8)
    assert len(_joined(q2, k2)) == 1
    assert len(_joined(q2, wide[:2, 32:48].view(2, 2, 8))) == 2  # token counts differ
    assert len(_joined(q2, wide[:, 32:64:2].unflatten(1, (2, 8)))) == 2  # k's head_dim is not contiguous
