"""atoll bench kernels: each Triton kernel against its torch reference and the device floor,
measured side by side in one run.

Per case: the kernel's time, the reference's (what runs with ATOLL_KERNELS=torch), their
ratio, and the floor, the least time any implementation could take: max(bytes that must move /
HBM bandwidth, FLOPs / bf16 peak), bandwidth and peak from the GPU's data sheet (topologies
presets; --hbm-tb-s / --tflops override). %floor = floor / time; 100% is a perfect kernel.
fused_moe's bytes are the weights of the experts the tokens hit, x and the output; activations
in between are not counted (a fully fused kernel need not write them).

Decode sizes put m = 1..64 rows on each expert (tokens = m * experts / top_k); prefill runs
--prefill-tokens tokens. Times are medians of triton.testing.do_bench, which flushes L2 between
runs, so weights come from HBM as in a real layer stack. fused_moe's parts (moe_align, the two
grouped_gemm launches, unpermute_reduce) are listed against their own floors; grouped_gemm has
no reference time (its reference is the float32 definition, not a baseline). fused_moe_fp8 runs
the same experts kept in fp8; its reference time is the dequantize-every-call path it replaced.

Without a GPU it says so and exits 0. --smoke runs tiny shapes on CPU in Triton's interpreter
(TRITON_INTERPRET=1) to check the bench itself; its times mean nothing.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from contextlib import nullcontext

import torch

from atoll.errors import AtollError
from atoll.kernels import backend, ops, reference
from atoll.kernels.configs import CANDIDATES, moe_config, rows_per_expert
from atoll.kernels.fp8 import dequantize_weight, quantize_weight
from atoll.kernels.fp8_moe import fused_moe_fp8
from atoll.kernels.moe import fused_moe
from atoll.topologies.discover import gpu_spec_for

MODELS = {  # the routed-expert shape of each family, all experts on the one GPU
    "mixtral-8x7b": dict(hidden=4096, inter=14336, experts=8, top_k=2),
    "qwen3-235b-a22b": dict(hidden=4096, inter=1536, experts=128, top_k=8),
    "deepseek-v3": dict(hidden=7168, inter=2048, experts=256, top_k=8),
}
SMOKE_MODEL = dict(hidden=64, inter=48, experts=8, top_k=2)
# (heads, kv_heads, rope dim, layout): Llama-70B-like, q and k views of the QKV projection's one
# output (as LlamaAttention splits it); DeepSeek MLA, the rope parts q_pe and k_pe in two tensors
ROTARY = ((32, 8, 128, "qkv"), (128, 1, 64, "separate"))
SMOKE_ROTARY = ((4, 2, 16, "qkv"), (4, 2, 16, "separate"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--models", default=",".join(MODELS), help=f"comma list of {', '.join(MODELS)}")
    p.add_argument("--rows-per-expert", default="1,4,16,64", help="decode sizes, rows per expert")
    p.add_argument("--prefill-tokens", type=int, default=4096, help="prefill tokens (default 4096; 0: none)")
    p.add_argument("--sweep", action="store_true", help="also time configs.CANDIDATES for fused_moe")
    p.add_argument("--rep-ms", type=int, default=50, help="do_bench time per measurement (default 50)")
    p.add_argument("--hbm-tb-s", type=float, default=None, help="HBM TB/s (default: data sheet)")
    p.add_argument("--tflops", type=float, default=None, help="bf16 dense TFLOPS (default: data sheet)")
    p.add_argument("--json", default=None, metavar="PATH", help="also write the rows as JSON")
    p.add_argument("--smoke", action="store_true", help="tiny shapes on CPU under TRITON_INTERPRET=1")


def add_parser(sub) -> None:
    """For cli/bench.py's BENCHES: `atoll bench kernels`."""
    p = sub.add_parser("kernels", help="Triton kernels vs torch reference vs device floor",
                       description=__doc__.split("\n\n")[1])
    add_arguments(p)
    p.set_defaults(run=run)


def _timer(smoke: bool, rep_ms: int):
    if not smoke:
        from triton.testing import do_bench  # lazy: Triton runs on a GPU only; --smoke times without it
        return lambda fn: do_bench(fn, warmup=max(5, rep_ms // 4), rep=rep_ms, return_mode="median") * 1e3

    def wall(fn):  # one call: the interpreter's times mean nothing anyway
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e6
    return wall


class Bench:
    def __init__(self, device, timer, bw_bytes_s, peak_flops):
        self.device, self.timer, self.bw, self.peak = device, timer, bw_bytes_s, peak_flops
        self.rows: list[dict] = []

    def add(self, kernel, case, fn, *, ref=None, bytes_=0, flops=0):
        us = self.timer(fn)
        ref_us = self.timer(ref) if ref is not None else None
        mem_us, math_us = bytes_ / self.bw * 1e6, flops / self.peak * 1e6
        floor = max(mem_us, math_us)
        row = dict(kernel=kernel, case=case, us=us, ref_us=ref_us, floor_us=floor,
                   bound="hbm" if mem_us >= math_us else "compute", pct_floor=100 * floor / us)
        self.rows.append(row)
        ref_s = f"{ref_us:10.1f} {ref_us / us:7.2f}x" if ref_us is not None else f"{'-':>10} {'-':>8}"
        print(f"{kernel:<16} {case:<34} {us:10.1f} {ref_s} {floor:10.1f} {row['pct_floor']:6.0f}% {row['bound']}",
              flush=True)
        return row


def _moe(b: Bench, name, shape, tokens, dtype, sweep, fp8_ref=False):
    h, inter, e, k = shape["hidden"], shape["inter"], shape["experts"], shape["top_k"]
    g = torch.Generator(device=b.device).manual_seed(0)
    x = torch.randn(tokens, h, device=b.device, dtype=dtype, generator=g)
    w13 = torch.randn(e, 2 * inter, h, device=b.device, dtype=dtype, generator=g) * h**-0.5
    w2 = torch.randn(e, h, inter, device=b.device, dtype=dtype, generator=g) * inter**-0.5
    ids = torch.rand(tokens, e, device=b.device, generator=g).topk(k, dim=-1).indices
    wts = torch.softmax(torch.randn(tokens, k, device=b.device, generator=g), -1)
    m = rows_per_expert(tokens, k, e)
    case = f"{name} T={tokens} m={m}"
    el, pairs, hit = x.element_size(), tokens * k, ids.unique().numel()
    io = 2 * tokens * h * el
    fused = b.add("fused_moe", case, lambda: fused_moe(x, w13, w2, ids, wts),
          ref=lambda: reference.fused_moe(x, w13, w2, ids, wts),
          bytes_=hit * 3 * inter * h * el + io, flops=6 * pairs * inter * h)

    _fp8_moe(b, case, x, w13, w2, ids, wts, hit=hit, io=io, flops=6 * pairs * inter * h, with_ref=fp8_ref)

    cfg = moe_config(tokens, k, e)
    align = ops.moe_align(ids, e, cfg.block_m)
    rows = int(align.rows.item())
    hh = ops.grouped_gemm(x, w13, align, gather=True, silu_mul=True, config=cfg.gemm1)
    y = ops.grouped_gemm(hh, w2, align, weights=wts, config=cfg.gemm2)
    b.add("  moe_align", case, lambda: ops.moe_align(ids, e, cfg.block_m),
          ref=lambda: reference.moe_align(ids, e, cfg.block_m), bytes_=pairs * 12 + align.max_rows * 4)
    b.add("  gemm1 silu*up", case, lambda: ops.grouped_gemm(x, w13, align, gather=True, silu_mul=True, config=cfg.gemm1),
          bytes_=hit * 2 * inter * h * el + tokens * h * el + rows * inter * el, flops=4 * pairs * inter * h)
    b.add("  gemm2 *weight", case, lambda: ops.grouped_gemm(hh, w2, align, weights=wts, config=cfg.gemm2),
          bytes_=hit * inter * h * el + rows * (inter + h) * el, flops=2 * pairs * inter * h)
    b.add("  unpermute", case, lambda: ops.unpermute_reduce(y, align),
          ref=lambda: reference.unpermute_reduce(y, align), bytes_=(pairs + tokens) * h * el)
    if sweep:  # the table's entry against the other tiles of the same block_m
        best = (fused["us"], cfg)
        for cand in (c for c in CANDIDATES if c.block_m == cfg.block_m and c != cfg):
            try:
                t = b.timer(lambda: fused_moe(x, w13, w2, ids, wts, config=cand))
            except Exception as err:  # a tile that does not fit this GPU (shared memory)
                print(f"  sweep {cand}: {type(err).__name__}", flush=True)
                continue
            print(f"  sweep {t:10.1f} us  {cand}", flush=True)
            best = min(best, (t, cand), key=lambda r: r[0])
        print(f"  sweep {case}: table {fused['us']:.1f} us, best {best[0]:.1f} us "
              f"({fused['us'] / best[0]:.2f}x) with {best[1]}", flush=True)
        b.rows.append(dict(kernel="sweep", case=case, table_us=fused["us"], best_us=best[0], best=repr(best[1])))


def _fp8_moe(b: Bench, case, x, w13, w2, ids, wts, *, hit, io, flops, with_ref):
    """The same experts kept in fp8 (per row and 128 columns): fused_moe_fp8 against what ran
    before it, the weights dequantized for the call and then fused_moe (bf16 fused_moe is the
    row above), timed at the first decode size only (with_ref: it is slow, and its float32 copy
    of every expert is large). Bytes: the hit experts' fp8 weights and float32 scales, x and
    the output."""
    q13, s13 = (torch.stack(t) for t in zip(*(quantize_weight(w) for w in w13)))
    q2, s2 = (torch.stack(t) for t in zip(*(quantize_weight(w) for w in w2)))
    per_expert = q13[0].numel() + q2[0].numel() + 4 * (s13[0].numel() + s2[0].numel())

    def dequantized():
        return fused_moe(x, dequantize_weight(q13.flatten(0, 1), s13.flatten(0, 1)).view(q13.shape).to(x.dtype),
                         dequantize_weight(q2.flatten(0, 1), s2.flatten(0, 1)).view(q2.shape).to(x.dtype), ids, wts)
    b.add("fused_moe_fp8", case, lambda: fused_moe_fp8(x, q13, s13, q2, s2, ids, wts),
          ref=dequantized if with_ref else None,
          bytes_=hit * per_expert + io, flops=flops)


def _row_kernels(b: Bench, dtype, smoke):
    el = torch.finfo(dtype).bits // 8
    hiddens, token_counts = ((64,), (1, 5)) if smoke else ((4096, 7168), (1, 64, 8192))
    for hidden in hiddens:
        for t in token_counts:
            x = torch.randn(t, hidden, device=b.device, dtype=dtype)
            res = torch.randn_like(x)
            w = torch.ones(hidden, device=b.device, dtype=dtype)
            b.add("rms_norm+res", f"T={t} H={hidden}", lambda: ops.rms_norm(x, w, 1e-6, residual=res),
                  ref=lambda: reference.rms_norm(x, w, 1e-6, residual=res), bytes_=(4 * t + 1) * hidden * el)
    for heads, kv, dim, layout in SMOKE_ROTARY if smoke else ROTARY:
        for t in token_counts:
            if layout == "qkv":  # q, k, v: views of one [t, (heads + 2 kv) * dim] buffer
                qkv = torch.randn(t, (heads + 2 * kv) * dim, device=b.device, dtype=dtype)
                q, k, _ = (x.view(t, -1, dim) for x in qkv.split([heads * dim, kv * dim, kv * dim], dim=-1))
            else:  # two tensors of their own (the allocator may place them end to end; still two)
                q = torch.randn(t, heads, dim, device=b.device, dtype=dtype)
                k = torch.randn(t, kv, dim, device=b.device, dtype=dtype)
            cos, sin = torch.randn(t, dim, device=b.device, dtype=dtype), torch.randn(t, dim, device=b.device, dtype=dtype)
            b.add("rotary", f"T={t} {heads}/{kv}x{dim} {layout}", lambda: ops.rotary_(q, k, cos, sin),
                  ref=lambda: reference.rotary_(q, k, cos, sin), bytes_=(2 * (heads + kv) + 2) * t * dim * el)


def run(args) -> int:
    unknown = [m for m in args.models.split(",") if m and m not in MODELS]
    if unknown:
        raise backend.KernelError(f"--models: unknown {', '.join(unknown)}; known: {', '.join(MODELS)}")
    try:
        per_expert = [int(m) for m in args.rows_per_expert.split(",")]
    except ValueError:
        raise backend.KernelError(f"--rows-per-expert {args.rows_per_expert!r} must be integers, comma separated") from None
    if not args.smoke and not torch.cuda.is_available():
        print("atoll bench kernels: needs a CUDA GPU (the Triton kernels run only there); nothing measured")
        return 0
    if not args.smoke and not backend.triton_available():
        raise backend.KernelError("atoll bench kernels needs triton: pip install triton")
    device = "cpu" if args.smoke else "cuda"
    name = "H200 (smoke: CPU interpreter, times mean nothing)" if args.smoke else torch.cuda.get_device_name()
    spec = gpu_spec_for("H200" if args.smoke else name)
    bw, peak = (args.hbm_tb_s or spec.hbm_tb_s) * 1e12, (args.tflops or spec.bf16_tflops) * 1e12
    print(f"device {name}: floor from {bw / 1e12:.2f} TB/s HBM, {peak / 1e12:.0f} TFLOPS bf16 ({spec.name})")
    b = Bench(device, _timer(args.smoke, args.rep_ms), bw, peak)
    if not args.smoke:
        buf = torch.empty(1 << 28, dtype=torch.uint8, device=device)  # 256 MiB copy: achievable HBM
        copy_us = b.timer(lambda: buf.clone())
        print(f"measured copy bandwidth: {2 * buf.numel() / copy_us / 1e6:.2f} TB/s (read + write)")
        del buf
    print(f"{'kernel':<16} {'case':<34} {'triton us':>10} {'torch us':>10} {'speedup':>8} {'floor us':>10} {'%floor':>7}")
    dtype = torch.bfloat16
    with backend.interpreter() if args.smoke else nullcontext():
        models = {"tiny": SMOKE_MODEL} if args.smoke else {m: MODELS[m] for m in args.models.split(",") if m}
        for model, shape in models.items():
            sizes = [max(1, m * shape["experts"] // shape["top_k"]) for m in per_expert]
            prefill = [9] if args.smoke else [args.prefill_tokens] if args.prefill_tokens > 0 else []
            for tokens in (sizes[:1] if args.smoke else sizes) + prefill:
                _moe(b, model, shape, tokens, dtype, args.sweep and not args.smoke, fp8_ref=tokens == sizes[0])
                if device == "cuda":
                    torch.cuda.empty_cache()
        _row_kernels(b, dtype, args.smoke)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dict(device=name, hbm_tb_s=bw / 1e12, tflops=peak / 1e12, rows=b.rows), f, indent=1)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m atoll.bench.kernels", description=__doc__.split("\n\n")[0])
    add_arguments(p)

    try:
        return run(p.parse_args(argv))
    except AtollError as e:  # one line and exit 2, as the atoll CLI does
        print(f"atoll: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
