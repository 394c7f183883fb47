"""The KV cache's lower tiers on one rank: host memory, a local disk directory and a shared
store (engine/kv/tiers) behind this rank's paged cache, for `--kv-offload-gb`, `--kv-disk-dir`
and `--kv-shared`.

A block is written through as it is computed: when the micro-batch that fills a named block has
passed this rank's stage, the block's bytes (every layer of this rank's slice, as stored: fp8
or int8 with their scales) are queued for the tiers' background writer, so the device pool can
later let the block go with nothing to write, a restarted server finds it on disk and another
replica finds it in the shared store.

A prompt whose leading blocks are not in the device pool asks the tiers (the scheduler's
`tiers.held`): the ranks agree on how many their tiers hold, and a reader thread on each rank
reads and checks them while the prompt steps aside and the engine goes on (tier_reads.py).
Once every rank has finished, the ranks agree on the count every one of them read, so every
rank schedules the same blocks. The scheduler gives those blocks device blocks, names them, and
starts the prompt's prefill after them; this module copies their bytes into the cache before
the tick runs.

Every rank's slice has its own namespace (the checkpoint, dtypes, block size, layout and this
rank's place in it), so a block of another model or layout is never read as this one's.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch

from atoll.engine.kv.tiers.chain import TierChain
from atoll.engine.kv.tiers.disk import DiskTier
from atoll.engine.kv.tiers.host import HostTier
from atoll.engine.kv.tiers.record import namespace
from atoll.engine.kv.tiers.shared import SharedTier
from atoll.engine.rank.tier_reads import Reads, continuing
from atoll.errors import ConfigError

GIB = 1 << 30


def _bytes_view(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.contiguous().view(torch.uint8)


def _gathered(cache, blocks: list[int]) -> torch.Tensor:
    """[len(blocks), bytes a block] on the cache's device: each block's row of every tensor the
    cache stores (KVCache.tensors), in order, as bytes."""
    ps = cache.tensors()
    ids = torch.tensor(blocks, dtype=torch.long, device=ps[0].device)
    return torch.cat([_bytes_view(p.index_select(0, ids)).reshape(len(blocks), -1) for p in ps], dim=1)


def read_blocks(cache, blocks: list[int]) -> list[bytes]:
    """Each block's bytes (_gathered), now."""
    whole = _gathered(cache, blocks).cpu().numpy()
    return [whole[i].tobytes() for i in range(len(blocks))]


class DeviceCopy:
    """One block's bytes on their way from a CUDA cache into pinned host memory: the copy runs on
    a side stream after the step that computed them, and the tiers' writer thread waits for it
    (`resolve`), so the engine thread never does."""

    def __init__(self, host: torch.Tensor, row: int, done):
        self.host, self.row, self.done = host, row, done

    def __len__(self) -> int:
        return self.host.shape[1]

    def resolve(self) -> bytes:
        self.done.synchronize()
        return self.host[self.row].numpy().tobytes()


def copy_blocks_out(cache, blocks: list[int], stream) -> list[DeviceCopy]:
    """read_blocks on CUDA without waiting: gathered on the compute stream, copied to pinned host
    memory on `stream` (a side stream) once the compute stream's work so far is done."""
    rows = _gathered(cache, blocks)
    stream.wait_stream(torch.cuda.current_stream(rows.device))
    host = torch.empty(rows.shape, dtype=torch.uint8, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(rows, non_blocking=True)
        rows.record_stream(stream)  # its memory is not reused before the copy has read it
        done = torch.cuda.Event()
        done.record(stream)
    return [DeviceCopy(host, i, done) for i in range(len(blocks))]


def write_blocks(cache, blocks: list[int], payloads: list[bytes]) -> None:
    """Copy each payload (read_blocks' bytes) into its block."""
    flat = torch.frombuffer(bytearray(b"".join(payloads)), dtype=torch.uint8).view(len(blocks), -1)
    ps = cache.tensors()
    if ps[0].device.type == "cuda":  # one copy up from pinned memory, then the slices on the device
        flat = flat.pin_memory().to(ps[0].device, non_blocking=True)
    ids = torch.tensor(blocks, dtype=torch.long, device=ps[0].device)
    at = 0
    for p in ps:
        n = p[0].numel() * p.element_size()
        dst = p.view(torch.uint8) if p.element_size() == 1 else p  # fp8 is written as its bytes
        rows = flat[:, at:at + n].contiguous().view(dst.dtype).view(len(blocks), *p.shape[1:])
        dst.index_copy_(0, ids, rows.to(p.device))
        at += n


class RankTiers:
    """This rank's tier chain and the hooks the scheduler (engine.batch.scheduler) and the
    rank loop call: `held`, `fill` and `computed` while scheduling, `apply` before the tick,
    `save` once this stage has computed a micro-batch."""

    def __init__(self, chain: TierChain, reads: Reads, *, size: int, runner=None):
        """reads: the reader of the ranks that schedule together; size: a block's bytes in a
        tier; runner: the rank's ModelRunner (its cache takes `apply` and gives `save`)."""
        self.runner, self.chain, self.reads, self.size = runner, chain, reads, size
        self._fetched: list[bytes] = []  # payloads of the last `held`
        self._again: set[int] = set()  # requests reading a second time (held)
        # reads taken by a prompt the pool had no room for yet: kept until its blocks are filled
        self._kept: dict[int, tuple[list[bytes], list[bytes]]] = {}
        self._holder: int | None = None  # the request of the last `held`
        self._fills: list[tuple[int, bytes]] = []  # (block, payload) to copy in before the tick
        self._new: list[tuple[int, bytes, bytes | None]] = []  # (block, name, parent) named this tick
        # on CUDA a block's bytes leave on a side stream into pinned memory (DeviceCopy)
        cuda = runner is not None and runner.device.type == "cuda"
        self.stream = torch.cuda.Stream(runner.device) if cuda else None

    @classmethod
    def build(cls, runner) -> RankTiers | None:
        """The rank's tiers from its engine flags, or None where none is asked for."""
        eng = runner.spec.engine
        if not (eng.kv_offload_gb or eng.kv_disk_dir or eng.kv_shared):
            return None
        lay = runner.ctx.layout
        if not eng.enable_prefix_caching:
            raise ConfigError("KV cache tiers hold prefix blocks: they need prefix caching (drop "
                              "--no-enable-prefix-caching)")
        if lay.cp > 1 or runner.window_pool is not None or (lay.dp > 1 and lay.tp > 1 and lay.pp > 1):
            raise ConfigError("KV cache tiers run with TP, PP and DP replicas; not yet with context parallel "
                              "stripes, a sliding layers' own cache, or TP, PP and DP all at once")
        rank = runner.ctx.rank
        tiers = [HostTier(int(eng.kv_offload_gb * GIB)) if eng.kv_offload_gb else None]
        if eng.kv_disk_dir:
            # a directory per rank (replicas' ranks too: two writers never share one)
            where = Path(eng.kv_disk_dir) / f"rank{rank}" if lay.world_size > 1 else Path(eng.kv_disk_dir)
            tiers.append(DiskTier(where, int(eng.kv_disk_gb * GIB) if eng.kv_disk_gb else None))
        if eng.kv_shared:
            tiers.append(SharedTier.open(eng.kv_shared))
        # the writer's queue: a quarter of the host tier (the memory the user gave the tiers), at
        # least 256 MiB, so one long prompt of large blocks is not dropped on its way down
        pending = max(256 << 20, int(eng.kv_offload_gb * GIB) // 4)
        chain = TierChain(tiers, namespace(**_slice(runner)), write_through=True, max_pending_bytes=pending)
        # the ranks that schedule together: the job, or with DP replicas this replica's tp or pp group
        ctx = runner.ctx
        group = ctx.world if lay.dp == 1 else ctx.tp if lay.pp == 1 else ctx.pp
        size = runner.cache.bytes_per_token * runner.cache.block_size
        return cls(chain, Reads(chain, group, runner.device), size=size, runner=runner)

    # --- the scheduler's hooks (every rank calls them in the same order) ---

    def held(self, seq, names: list[bytes]) -> int | None:
        """How many leading blocks of `names` every rank has read from its tiers for `seq`
        (their payloads kept for `fill`); None while they are being read (tier_reads)."""
        index = seq.request.index
        self._holder = index
        if index in self._kept:  # read before, then no room in the pool: the same payloads, not a new read
            got = continuing(*self._kept[index], names)
            if got:
                self._fetched = got
                return len(got)
            del self._kept[index]
        if self.reads.ready(index):
            self._fetched = self.reads.take(index, names)
            if self._fetched:
                self._kept[index] = (names[:len(self._fetched)], self._fetched)
            if self._fetched or index in self._again:
                self._again.discard(index)
                return len(self._fetched)
            # none of the read continues the pool's blocks: while the prompt stood aside, others
            # ran and the pool let go of blocks before the read's first. Read again from the
            # first block it lacks now (once: every rank decides the same, from the same pool)
            self._again.add(index)
        elif self.reads.reading(index):
            return None
        if self.reads.start(index, names):
            return None
        self._again.discard(index)
        self._fetched = []
        return 0

    def ready(self, seq) -> bool:
        return self.reads.ready(seq.request.index)

    def cancel(self, seq) -> None:
        self._again.discard(seq.request.index)
        self._kept.pop(seq.request.index, None)
        self.reads.cancel(seq.request.index)

    def poll(self) -> None:
        """At each tick's start, every rank: the reads all ranks have finished (tier_reads)."""
        self.reads.poll()

    def idle(self) -> None:
        """A tick without a micro-batch: wait briefly for a read rather than spin."""
        self.reads.idle()

    def fill(self, block: int, i: int) -> None:
        """Block `block` takes the i-th payload of the last `held`."""
        self._kept.pop(self._holder, None)  # admitted: its payloads go into the cache now
        payload = self._fetched[i]
        if len(payload) != self.size:  # the namespace covers the layout: this is a bug, not a miss
            raise RuntimeError(f"a tier's block holds {len(payload)} bytes where this cache's take {self.size}")
        self._fills.append((block, payload))

    def computed(self, block: int, name: bytes, parent: bytes | None) -> None:
        """A block is named this tick: its bytes go to the tiers once computed."""
        self._new.append((block, name, parent))

    # --- the rank loop ---

    def apply(self) -> None:
        """Copy the blocks brought up this tick into the cache (before the tick reads them)."""
        if self._fills:
            blocks, payloads = zip(*self._fills)
            write_blocks(self.runner.cache, list(blocks), list(payloads))
            self._fills.clear()
        self._fetched = []

    def take_new(self) -> list[tuple[int, bytes, bytes | None]]:
        """The blocks named this tick, for the micro-batch that computes them."""
        new, self._new = self._new, []
        return new

    def save(self, new: list[tuple[int, bytes, bytes | None]]) -> None:
        """Queue the bytes of blocks this stage has just computed for the tiers' writer (on CUDA
        still on their way to pinned memory: the writer waits for them, not this thread)."""
        blocks = [b for b, _, _ in new]
        payloads = read_blocks(self.runner.cache, blocks) if self.stream is None \
            else copy_blocks_out(self.runner.cache, blocks, self.stream)
        for (_, name, parent), payload in zip(new, payloads):
            self.chain.offload(name, parent, payload)

    def stats(self) -> dict:
        """Flat counters for the engine's step stats: kv_tier_<tier>_<counter>, checksum misses."""
        s = self.chain.stats()
        out = {}
        for tier in ("host", "disk", "shared"):
            for k, v in (s.get(tier) or {}).items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    out[f"kv_tier_{tier}_{k}"] = v
        out["kv_tier_checksum_misses"] = sum(s["checksum_misses"].values())
        out["kv_tier_writes_dropped"] = s["writes_dropped"]
        return out

    def close(self) -> None:
        """Finish the queued writes (a restart finds them) and stop the writer and the reader."""
        self.reads.close()
        self.chain.close(timeout=60.0)


def _slice(runner) -> dict:
    """What a block's bytes depend on besides its tokens: the checkpoint (its config and a
    fingerprint of this rank's first weights), dtypes, block size, the TP and PP split and this
    rank's place in it."""
    spec, ctx = runner.spec, runner.ctx
    config = (Path(spec.model_dir) / "config.json").read_text() if (Path(spec.model_dir) / "config.json").exists() \
        else json.dumps(vars(runner.config), default=str, sort_keys=True)
    first = next(runner.model.parameters())
    sample = first.detach().reshape(-1)[:1024].float().cpu().numpy().tobytes()
    return {"config": hashlib.blake2b(config.encode(), digest_size=16).hexdigest(),
            "weights": hashlib.blake2b(sample, digest_size=16).hexdigest(),
            "dtype": str(runner.dtype), "kv_cache_dtype": spec.engine.kv_cache_dtype, "kv_scales": runner.cache.scales_digest(),
            "quantization": spec.engine.quantization, "block_size": spec.engine.block_size,
            # the slice a rank's cache holds: DP replicas (and an MoE's expert split) hold the same
            "tp": ctx.layout.tp, "pp": ctx.layout.pp, "tp_rank": ctx.coords.tp, "pp_stage": ctx.coords.pp,
            "planes": [(str(p.dtype), tuple(p.shape[1:])) for p in runner.cache.tensors()]}
