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


def copy_fits(nbytes: int, ranks_here: int) -> bool:
    """Whether one more copy of nbytes on each of this machine's ranks fits in a quarter of its
    available memory (the rule for prepacked weight copies)."""
    return nbytes * ranks_here <= available_memory() // 4


def available_memory() -> int:
    """Bytes this machine can still give (psutil's available memory)."""
    import psutil

    return psutil.virtual_memory().available
