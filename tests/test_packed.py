"""MKL-packed decode weights (opt-in: the config's mkl_pack, env ATOLL_MKL_PACK=1): F.linear to float32 tolerance (bit for
bit on some CPUs, not on every one), packed only for a batch size that persists."""

import pytest
import torch
import torch.nn.functional as F

from atoll.layers import packed

pytestmark = pytest.mark.skipif(not packed.mkl_can_pack(), reason="torch without MKL packed GEMM")


def test_packed_linear_is_f_linear():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 40, generator=g), torch.randn(96, generator=g)
    packer = packed.Packer([w])
    packer.pack(5)
    assert w.packed[0] == 5
    for rows in (1, 5, 7):  # 5 runs packed, the others fall back to F.linear
        x = torch.randn(rows, 40, generator=g)
        if rows == 5:  # MKL's packed GEMM may sum in another order than its plain one
            torch.testing.assert_close(packed.linear(x, w, b), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(packed.linear(x, w, b), F.linear(x, w, b))


def test_packs_after_a_size_persists_and_only_float32_cpu_weights():
    w32, w16 = torch.randn(8, 4), torch.randn(8, 4, dtype=torch.bfloat16)
    packer = packed.Packer([w32, w16], patience=3)
    assert packer.weights == [w32]
    for rows in (4, 4, 2, 4, 4):  # a change of size restarts the count
        packer.observe(rows)
    assert packer.rows is None
    packer.observe(4)
    assert packer.rows == 4 and w32.packed[0] == 4 and not hasattr(w16, "packed")
    packer.observe(4)  # already packed for 4: nothing to do
    assert packer.rows == 4


def test_off_unless_asked_for():
    from atoll.config import resolve

    assert resolve(environ={}).mkl_pack is False
    assert resolve(environ={"ATOLL_MKL_PACK": "1"}).mkl_pack is True
    assert resolve(environ={"ATOLL_MKL_PACK": "0"}).mkl_pack is False
