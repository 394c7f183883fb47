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
    def __init__(self, num_blocks: int, block_size: int, first: int = 0, hole: int | None = None,
                 stripes: int = 1):
        """Blocks first .. first + num_blocks - 1 of the cache. hole: the cache's scratch block,
        which stands in a table for blocks let go of before its end (`free_before`).
        stripes: context parallel ranks (cp). Block j of every table lives on rank j % stripes,
        so each rank keeps a share of every sequence: the pool hands out global ids
        local * stripes + rank, local in first .. first + num_blocks - 1 on each rank (num_blocks
        per rank; self.num_blocks counts them all), and a rank reads global id g as its local
        block g // stripes. With one stripe a global id is the block itself."""
        if num_blocks < 1 or block_size < 1 or stripes < 1:
            raise ValueError(f"need at least one block of at least one token, got {num_blocks} x {block_size}")
        self.num_blocks, self.block_size, self.stripes = num_blocks * stripes, block_size, stripes
        # pop() hands out first, first + 1, ... on each rank
        self._free = [[local * stripes + s for local in range(first + num_blocks - 1, first - 1, -1)]
                      for s in range(stripes)]
        # named, unreferenced blocks per rank; oldest first
        self._evictable: list[OrderedDict[int, None]] = [OrderedDict() for _ in range(stripes)]
        self._refs: dict[int, int] = {}  # block -> holders, for every block in use
        self._named: dict[bytes, int] = {}  # hash -> block
        self._name_of: dict[int, bytes] = {}  # block -> hash
        self.evictions = 0
        self.hole = hole
        # cache events, when someone listens (a disaggregated job's driver): (True, name) as a
        # block is named, (False, name) as it is evicted; drained by whoever set the list
        self.events: list[tuple[bool, bytes]] | None = None

    @property
    def num_free(self) -> int:
        """Blocks a sequence can be given: never named, or named but unreferenced."""
        return sum(self.free_on(s) for s in range(self.stripes))

    def free_on(self, stripe: int) -> int:
        """Blocks rank `stripe` can still give."""
        return len(self._free[stripe]) + len(self._evictable[stripe])

    @property
    def num_cached(self) -> int:
        """Named blocks, in use or evictable."""
        return len(self._named)

    def blocks_for(self, tokens: int) -> int:
        return -(-tokens // self.block_size)

    def _needs(self, have: int, tokens: int) -> list[int]:
        """Blocks each rank must give to grow a table of `have` blocks to hold `tokens` positions."""
        need = [0] * self.stripes
        for j in range(have, self.blocks_for(tokens)):
            need[j % self.stripes] += 1
        return need

    def fits(self, hits: list[int], tokens: int) -> bool:
        """Whether a table of the cached blocks `hits` (shared first) can grow to `tokens` positions."""
        need = self._needs(len(hits), tokens)
        return all(n <= self.free_on(s) - sum(b in self._evictable[s] for b in hits[s::self.stripes])
                   for s, n in enumerate(need))

    def table(self) -> list[int]:
        """A new sequence's (empty) block table."""
        return []

    def can_grow(self, table: list[int], tokens: int) -> bool:
        """Whether `grow(table, tokens)` would succeed."""
        return all(n <= self.free_on(s) for s, n in enumerate(self._needs(len(table), tokens)))

    def grow(self, table: list[int], tokens: int) -> bool:
        """Extend table to hold `tokens` positions; False (and no change) if blocks run out."""
        if len(table) * self.block_size >= tokens:
            return True  # it holds them already (most decode steps)
        if not self.can_grow(table, tokens):
            return False
        for j in range(len(table), self.blocks_for(tokens)):
            s = j % self.stripes
            block = self._free[s].pop() if self._free[s] else self._evict(s)
            self._refs[block] = 1
            table.append(block)
        return True

    def _evict(self, stripe: int) -> int:
        block, _ = self._evictable[stripe].popitem(last=False)
        name = self._name_of.pop(block)
        del self._named[name]
        self.evictions += 1
        if self.events is not None:
            self.events.append((False, name))
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
                self._evictable[block % self.stripes][block] = None
            else:
                self._free[block % self.stripes].append(block)
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
        return sum(b in self._evictable[b % self.stripes] for b in blocks)

    def share(self, table: list[int], blocks: list[int]) -> None:
        """Append cached blocks to an empty table, one more holder each."""
        for block in blocks:
            if block in self._evictable[block % self.stripes]:
                del self._evictable[block % self.stripes][block]
            self._refs[block] = self._refs.get(block, 0) + 1
            table.append(block)

    def name_at(self, table: list[int], i: int, name: bytes) -> None:
        """Name the table's block i (see name)."""
        self.name(table[i], name)

    def name(self, block: int, name: bytes) -> None:
        """Record that a held, fully computed block holds the prefix `name`. If another block
        already holds it (two sequences computed the same prefix at once), the first keeps it
        and this one stays unnamed."""
        if name not in self._named and block not in self._name_of and block != self.hole:
            self._named[name] = block
            self._name_of[block] = name
            if self.events is not None:
                self.events.append((True, name))
