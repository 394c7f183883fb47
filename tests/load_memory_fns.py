"""Rank function for test_load_memory: build this rank's model on the CPU, load it from a
checkpoint, and sample the rank's anonymous resident memory (psutil's rss - shared, i.e.
RssAnon) while it loads. Module level, so spawned ranks can import it."""

import threading

_SAMPLE_S = 0.002


def measure_load(rank: int, world_size: int, model_dir: str) -> dict:
    import psutil
    import torch

    from atoll.models import ModelConfig, build_model
    from atoll.models.checkpoint import Checkpoint, load_weights
    from atoll.parallel.layout import Layout
    from atoll.parallel.mesh import ParallelContext

    proc = psutil.Process()

    def anon() -> int:
        # file-backed pages (the safetensors mmap) are page cache, not this rank's memory
        m = proc.memory_info()
        return m.rss - m.shared

    ctx = ParallelContext.single() if world_size == 1 else ParallelContext.create(Layout(tp=world_size), rank)
    before = anon()
    model = build_model(ModelConfig.load(model_dir), ctx, dtype=torch.float32)
    param_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    # torch.empty leaves pages uncommitted; loading would commit them one by one and hide a
    # transient under the still-growing total. Touched first, they make the total flat, so
    # anything above it during the load is what reading slices costs.
    for p in model.parameters():
        p.data.zero_()

    samples = []
    largest = [0]

    class Probe:
        """A checkpoint tensor that samples memory the moment each slice is handed out."""

        def __init__(self, src):
            self.src = src

        @property
        def shape(self):
            return self.src.shape

        def __getitem__(self, index):
            t = self.src[index]
            samples.append(anon())
            largest[0] = max(largest[0], t.numel() * t.element_size())
            return t

    class ProbedCheckpoint(Checkpoint):
        def get(self, name):
            return Probe(super().get(name))

    ckpt = ProbedCheckpoint(model_dir)
    stop = threading.Event()

    def sample():
        while not stop.is_set():
            samples.append(anon())
            stop.wait(_SAMPLE_S)

    start = anon()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        load_weights(model, ckpt)
    finally:
        stop.set()
        sampler.join()
    after = anon()
    return {"before": before, "start": start, "peak": max(samples + [after]), "after": after,
            "param_bytes": param_bytes, "bytes_read": ckpt.bytes_read, "largest_read": largest[0],
            "samples": len(samples)}
