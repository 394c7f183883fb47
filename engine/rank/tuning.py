"""The eager CPU step's products, tuned: oneDNN-packed weights where they measure faster here,
or MKL-packed ones when the config asks (layers.packed)."""

from __future__ import annotations

import sys
import time

from atoll.engine.step.memory import copy_fits
from atoll.layers import packed


def tune_eager(runner) -> bool:
    """Eager CPU decode (also under --compile never), unless --enforce-eager: each linear
    weight shape whose oneDNN-packed product measures faster than F.linear here, at the decode
    batch this run expects (times 1 + K when speculating: the verify step's rows), is
    packed (layers.packed.tune_onednn; no compile, a fraction of a second), when a second copy
    of the weights fits as for the compiled step. Rank 0 says what it chose. Returns whether
    it tuned (a job too short to repay the tuning is not tuned)."""
    eng = runner.spec.engine
    layers = runner.model.linear_layers()
    if eng.enforce_eager or not eng.compile_freezing or runner.device.type != "cpu":
        return False
    steps = runner.spec.decode_steps
    if not layers or (steps is not None and steps < packed.TUNE_MIN_STEPS):
        return False
    if not copy_fits(_weight_bytes(layers), runner.ranks_here):
        return False
    rows = min(runner.spec.cache_seqs or eng.max_num_seqs, eng.max_num_seqs)
    rows *= 1 + (runner.spec_k or 0)  # a verify step scores each sequence's pending token and its drafts
    t0 = time.perf_counter()
    done = packed.tune_onednn(layers, rows)
    if runner.ctx.rank == 0 and done["weights"]:
        print(f"atoll: eager decode: {done['packed']} of {done['weights']} weights packed for oneDNN, "
              f"measured {done['plain_s'] * 1e3:.1f} -> {done['packed_s'] * 1e3:.1f} ms of products a step at "
              f"{min(rows, packed.EAGER_MAX_ROWS)} rows ({time.perf_counter() - t0:.1f} s; --enforce-eager: none)",
              file=sys.stderr, flush=True)
    return True


def packer_for(model, ranks_here: int, enabled: bool):
    """MKL-packed decode weights for a CPU float32 model (layers.packed) when the config's
    mkl_pack asks for them, or None: also when
    the second copy of the weights would take more than a quarter of this machine's free
    memory, shared by its ranks."""
    layers = model.linear_layers()
    if not enabled or not packed.mkl_can_pack() or not layers or layers[0].weight.device.type != "cpu":
        return None
    if not copy_fits(_weight_bytes(layers), ranks_here):
        return None
    return packed.Packer(layers)


def _weight_bytes(layers) -> int:
    return sum(m.weight.numel() * m.weight.element_size() for m in layers)
