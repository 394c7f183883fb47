"""BlockPool: which KV cache blocks are free. Every rank of a replica runs the same
allocation sequence, so the block ids agree without any communication."""

from __future__ import annotations


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, first: int = 0):
        """Blocks first .. first + num_blocks - 1 of the cache."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(first + num_blocks - 1, first - 1, -1))  # pop() hands out first, first + 1, ...

    @property
    def num_free(self) -> int:
        return len(self._free)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def grow(self, table: list[int], tokens: int) -> bool:
        """Extend table to hold `tokens` positions; False (and no change) if blocks run out."""
        need = self.blocks_for(tokens) - len(table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        table.extend(self._free.pop() for _ in range(need))
        return True

    def release(self, table: list[int]) -> None:
        self._free.extend(reversed(table))
        table.clear()


def available_memory() -> int:
    """Bytes this machine can still give: MemAvailable from /proc/meminfo (CPU ranks)."""
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 8 << 30


def size_pool(*, bytes_per_block: int, block_size: int, max_num_seqs: int, max_model_len: int,
              ranks_here: int, kv_cache_gb: float | None = None, num_blocks: int | None = None) -> int:
    """Blocks per rank: --num-blocks, else --kv-cache-gb, else enough for max_num_seqs full-length
    sequences capped at a quarter of the free memory shared by this machine's ranks."""
    from atoll.errors import InputError

    per_seq = -(-max_model_len // block_size)
    if num_blocks is None:
        if kv_cache_gb is not None:
            num_blocks = int(kv_cache_gb * (1 << 30)) // bytes_per_block
        else:
            cap = available_memory() // 4 // max(1, ranks_here) // bytes_per_block
            num_blocks = min(max_num_seqs * per_seq, cap)
    if num_blocks < per_seq:
        raise InputError(f"the KV cache holds {num_blocks * block_size} tokens per replica but one "
                         f"sequence may need max_model_len={max_model_len}: raise --kv-cache-gb or "
                         f"--num-blocks, or lower --max-model-len")
    return num_blocks
