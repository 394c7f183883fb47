"""BlockPool: which KV cache blocks are free, and (with prefix caching) which hold a known
run of tokens. Every rank of a replica runs the same allocation sequence, so the block ids
agree without any communication.

Prefix caching: a full block is named by `block_hash(parent's hash, its token ids)`, so a
name stands for the whole prefix up to the block's end. Blocks are reference-counted; a
block whose last holder lets go keeps its name and waits, evictable, in least-recently-used
order. A new block comes from the never-named free blocks first, then by evicting the least
recently used named one (its name is forgotten).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict

import psutil


def block_hash(parent: bytes | None, tokens) -> bytes:
    """The name of a full block: a digest of its parent's name and its token ids (hashlib,
    so every process agrees; Python's hash() of bytes changes per process)."""
    h = hashlib.blake2b(parent or b"", digest_size=16)
    h.update(array("q", tokens).tobytes())
    return h.digest()


def prefix_names(tokens, block_size: int, blocks: int | None = None) -> list[bytes]:
    """The names of the first `blocks` full blocks of tokens (default: every full block), each
    chained on the one before: what the pool calls those blocks once they are computed."""
    count = len(tokens) // block_size if blocks is None else blocks
    names: list[bytes] = []
    for i in range(count):
        names.append(block_hash(names[-1] if i else None, tokens[i * block_size:(i + 1) * block_size]))
    return names


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, first: int = 0, hole: int | None = None):
        """Blocks first .. first + num_blocks - 1 of the cache. hole: the cache's scratch block,
        which stands in a table for blocks let go of before its end (`free_before`)."""
        if num_blocks < 1 or block_size < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size = num_blocks, block_size
        self._free = list(range(first + num_blocks - 1, first - 1, -1))  # pop() hands out first, first + 1, ...
        self._evictable: OrderedDict[int, None] = OrderedDict()  # named, unreferenced; oldest first
        self._refs: dict[int, int] = {}  # block -> holders, for every block in use
        self._named: dict[bytes, int] = {}  # hash -> block
        self._name_of: dict[int, bytes] = {}  # block -> hash
        self.evictions = 0
        self.hole = hole

    @property
    def num_free(self) -> int:
        """Blocks a sequence can be given: never named, or named but unreferenced."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        """Named blocks, in use or evictable."""
        return len(self._named)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def grow(self, table: list[int], tokens: int) -> bool:
        """Extend table to hold `tokens` positions; False (and no change) if blocks run out."""
        need = self.blocks_for(tokens) - len(table)
        if need <= 0:
            return True
        if need > self.num_free:
            return False
        for _ in range(need):
            block = self._free.pop() if self._free else self._evict()
            self._refs[block] = 1
            table.append(block)
        return True

    def _evict(self) -> int:
        block, _ = self._evictable.popitem(last=False)
        del self._named[self._name_of.pop(block)]
        self.evictions += 1
        return block

    def release(self, table: list[int]) -> None:
        """Let go of every block of the table. Unnamed ones are free at once; named ones wait
        as evictable, the table's last blocks nearest eviction (a later prefix is worth less:
        it is only reused when everything before it is)."""
        for block in reversed(table):
            if block == self.hole:
                continue
            self._refs[block] -= 1
            if self._refs[block]:
                continue
            del self._refs[block]
            if block in self._name_of:
                self._evictable[block] = None
            else:
                self._free.append(block)
        table.clear()

    def free_before(self, table: list[int], blocks: int) -> int:
        """Let go of the table's first `blocks` blocks (a sliding window has passed them: no
        query reads them again), each replaced by the hole so the table keeps its positions.
        Returns how many were let go now."""
        gone = [b for b in table[:blocks] if b != self.hole]
        table[:blocks] = [self.hole] * blocks
        count = len(gone)
        self.release(gone)
        return count

    def trim(self, table: list[int], tokens: int) -> None:
        """Let go of the table's blocks past the first `tokens` positions (speculative rollback:
        rejected drafts' blocks, never named, go back to the free list)."""
        keep = self.blocks_for(tokens)
        if len(table) > keep:
            tail = table[keep:]
            del table[keep:]
            self.release(tail)

    def lookup(self, names: list[bytes]) -> list[int]:
        """The blocks named by the leading names that are cached (stops at the first miss)."""
        hits = []
        for name in names:
            block = self._named.get(name)
            if block is None:
                break
            hits.append(block)
        return hits

    def reusable(self, blocks: list[int]) -> int:
        """How many of these cached blocks are evictable now (sharing them takes them off the free count)."""
        return sum(b in self._evictable for b in blocks)

    def share(self, table: list[int], blocks: list[int]) -> None:
        """Append cached blocks to an empty table, one more holder each."""
        for block in blocks:
            if block in self._evictable:
                del self._evictable[block]
            self._refs[block] = self._refs.get(block, 0) + 1
            table.append(block)

    def name(self, block: int, name: bytes) -> None:
        """Record that a held, fully computed block holds the prefix `name`. If another block
        already holds it (two sequences computed the same prefix at once), the first keeps it
        and this one stays unnamed."""
        if name not in self._named and block not in self._name_of and block != self.hole:
            self._named[name] = block
            self._name_of[block] = name


def copy_fits(nbytes: int, ranks_here: int) -> bool:
    """Whether one more copy of nbytes on each of this machine's ranks fits in a quarter of its
    available memory (the rule for prepacked weight copies)."""
    return nbytes * ranks_here <= available_memory() // 4


def available_memory() -> int:
    """Bytes this machine can still give (psutil's available memory)."""
    return psutil.virtual_memory().available
