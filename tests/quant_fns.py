"""Rank function for the quantization tests: build this rank's ModelRunner from the run's
spec and report what its weights hold. Module level, so spawned ranks can import it."""


def weight_report(rank: int, world_size: int, spec, parallel=None, device: str = "cpu", node=None,
                  ranks_here=None) -> dict:
    from collections import Counter

    from atoll.engine.runner import ModelRunner
    from atoll.layers.quant_linear import weight_bytes
    from atoll.parallel.layout import Layout
    from atoll.parallel.mesh import ParallelContext

    layout = Layout.parse(spec.layout)
    ctx = ParallelContext.create(layout, rank, device, parallel, node=node) if world_size > 1 \
        else ParallelContext.single(device, parallel)
    runner = ModelRunner(spec, ctx, ranks_here=ranks_here)
    dtypes = Counter(str(p.dtype).removeprefix("torch.") for p in runner.model.parameters())
    return {"rank": rank, "bytes": weight_bytes(runner.model), "dtypes": dict(dtypes)}
