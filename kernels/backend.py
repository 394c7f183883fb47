"""Which path a kernel call takes: the Triton kernel or its torch reference.

    auto    (default) Triton when every tensor is on CUDA and triton imports
    torch   always the torch reference (kernels off)
    triton  always Triton; on CPU tensors that needs Triton's interpreter,
            TRITON_INTERPRET=1 in the environment before triton is first imported
            (interpreter() below checks it, for tests)

The mode is the config's `kernels` field (--kernels, LLM(kernels=...), env ATOLL_KERNELS),
set only for a block with `using(mode)`: a rank runs its job inside using(its spec's kernels)
(engine/worker.py), tests and benchmarks their own blocks; outside any block it is "auto".
triton is imported only when the Triton path is taken, so `import atoll.kernels` works
without it.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import os
import sys

import torch

from atoll.errors import AtollError

MODES = ("auto", "torch", "triton")
_mode = "auto"
# the modules holding @triton.jit functions; each records INTERPRETED at import
TRITON_MODULES = tuple(f"atoll.kernels.triton_{m}" for m in ("moe_align", "grouped_gemm", "unpermute",
                                                              "rms_norm", "rotary", "paged_attention",
                                                              "mla_decode", "fp8_gemm", "paged_prefill",
                                                              "fp8_grouped_gemm"))


class KernelError(AtollError):
    """Inputs a kernel cannot take (shape, dtype, device), or a backend that cannot run."""


def mode() -> str:
    return _mode


def _set(value: str) -> None:
    global _mode
    if value not in MODES:
        raise KernelError(f"kernels={value!r} is not one of {', '.join(MODES)}")
    _mode = value


@contextlib.contextmanager
def using(value: str):
    """The kernel mode `value` (the config's `kernels`) inside this block, the previous one
    after it."""
    saved = _mode
    _set(value)
    try:
        yield
    finally:
        _set(saved)


@functools.cache
def triton_available() -> bool:
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # ImportError, or a broken install that fails while importing
        return False
    return True


def interpreting() -> bool:
    """TRITON_INTERPRET as triton reads it."""
    return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on", "yes")


def triton_interpreted() -> bool | None:
    """Whether the triton already imported in this process runs kernels in its interpreter;
    None when triton is not imported yet. Triton fixes this when it is first imported (its
    own library functions are built then), so TRITON_INTERPRET set later does not switch it."""
    if "triton.language" not in sys.modules:
        return None
    return type(sys.modules["triton.language"].zeros).__name__ == "InterpretedFunction"


def fp8_dot_supported(t: torch.Tensor) -> bool:
    """Whether the device multiplies fp8 in its tensor cores (compute capability 8.9 and up:
    Ada, Hopper, Blackwell); the interpreter on the CPU takes it too. Older GPUs (an A100)
    dequantize fp8 weights instead."""
    return not t.is_cuda or _capability(t.device.index) >= (8, 9)


@functools.lru_cache(maxsize=None)
def _capability(index: int | None) -> tuple[int, int]:
    """A device's compute capability, asked once (the MoE layers ask every call)."""
    return torch.cuda.get_device_capability(index)


def use_triton(*tensors: torch.Tensor) -> bool:
    """True when this call should run the Triton kernel (see the module docstring)."""
    m = mode()
    if m == "torch":
        return False
    on_cuda = all(t.is_cuda for t in tensors)
    if m == "auto":
        return on_cuda and triton_available()
    if not on_cuda and not interpreting():
        raise KernelError("kernels=triton on CPU tensors needs TRITON_INTERPRET=1 (Triton's interpreter)")
    if not on_cuda and triton_interpreted() is False:
        raise KernelError("triton was imported before TRITON_INTERPRET=1 was set; its interpreter "
                          "needs the variable set before the first import")
    if not triton_available():
        raise KernelError("kernels=triton but triton is not importable: pip install triton")
    return True


def check(cond: bool, message: str) -> None:
    """Raise KernelError(message) unless cond: the one-line checks of a kernel's inputs."""
    if not cond:
        raise KernelError(message)


def _sync_modules() -> None:
    """Re-execute any atoll kernel module imported under the other TRITON_INTERPRET setting:
    @triton.jit decides compiled vs interpreted when the module runs."""
    now = interpreting()
    for name in TRITON_MODULES:
        module = sys.modules.get(name)
        if module is not None and getattr(module, "INTERPRETED", None) != now:
            importlib.reload(module)


@contextlib.contextmanager
def interpreter():
    """Inside this block kernel calls take the Triton path on CPU tensors, run by Triton's
    interpreter: how tests check the kernels (and a model's parity with the kernels forced on)
    on a machine without a GPU. The process must have started with TRITON_INTERPRET=1 in its
    environment (triton fixes the mode at its first import and cannot switch); the kernel mode
    is triton until the block ends.

    Raises KernelError, naming what to do, when TRITON_INTERPRET=1 is not set or triton was
    imported without it."""
    if not interpreting():
        raise KernelError("Triton's interpreter needs TRITON_INTERPRET=1 in the environment the process "
                          "started with (e.g. TRITON_INTERPRET=1 atoll bench kernels --smoke)")
    if triton_interpreted() is False:
        raise KernelError("triton was imported in this process before TRITON_INTERPRET=1 was set; "
                          "start a fresh process with TRITON_INTERPRET=1 in its environment")
    if not triton_available():
        raise KernelError("Triton's interpreter needs triton: pip install triton")
    _sync_modules()
    with using("triton"):
        yield
