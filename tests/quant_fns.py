"""Rank function for the quantization tests: build this rank's ModelRunner from the run's
spec and report what its weights hold. Module level, so spawned ranks can import it."""


def weight_report(rank: int, world_size: int, spec, parallel=None, device: str = "cpu", node=None,
                  ranks_here=None) -> dict:
    from collections import Counter

    import torch

    from atoll.engine.rank.runner import ModelRunner
    from atoll.layers.quant_linear import weight_bytes
    from atoll.parallel.layout import Layout
    from atoll.parallel.mesh import ParallelContext

    layout = Layout.parse(spec.layout)
    ctx = ParallelContext.create(layout, rank, device, parallel, node=node) if world_size > 1 \
        else ParallelContext.single(device, parallel)
    runner = ModelRunner(spec, ctx, ranks_here=ranks_here)
    params = list(runner.model.parameters())
    dtypes = Counter(str(p.dtype).removeprefix("torch.") for p in params)
    fp8 = [p for p in params if p.dtype == torch.float8_e4m3fn]
    scales = [t for n, t in runner.model.named_buffers() if n.endswith("_scale")]
    return {"rank": rank, "bytes": weight_bytes(runner.model), "dtypes": dict(dtypes),
            "fp8_elements": sum(p.numel() for p in fp8), "fp8_bytes": sum(p.numel() * p.element_size() for p in fp8),
            "scale_bytes": sum(t.numel() * t.element_size() for t in scales),
            "param_bytes": {n: p.numel() * p.element_size() for n, p in runner.model.named_parameters()},
            "input_scales": {n: float(t) for n, t in runner.model.named_buffers() if n.endswith("input_scale")},
            "fp8_names": sorted(n for n, p in runner.model.named_parameters() if p.dtype == torch.float8_e4m3fn)}
