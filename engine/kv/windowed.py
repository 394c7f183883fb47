"""WindowedPool: block tables for a model whose sliding-window layers sit beside
full-attention layers (Qwen2/3's max_window_layers, config.json's layer_types).

The full-attention layers read every position of a sequence; the sliding layers read only the
last `width` positions (the widest of their windows). So the sliding layers keep their own
cache, with its own, smaller pool of blocks, and a sequence holds two tables at the same
positions: its list of full-layer block ids (a WindowTable, the list every other part of the
engine reads) and, beside it, `table.window`, the sliding layers' blocks. As the sequence moves
on, the sliding blocks wholly before its window go back to their pool (the scheduler's
`free_before`; the hole, the sliding cache's scratch block, keeps their places), so a long
sequence holds about width / block_size sliding blocks however long it grows.

The pool answers the scheduler as one BlockPool does, doing each thing to both tables. With
prefix caching both pools name their blocks; a cached prefix is reused as far as the full
pool holds it and the sliding pool holds the blocks its first query's window reads (earlier
sliding blocks may be gone: no sliding layer reads them again).
"""

from __future__ import annotations

from atoll.engine.kv.blocks import BlockPool


class WindowTable(list):
    """A sequence's full-layer block ids; `window`: its sliding layers' ids at the same positions."""

    def __init__(self, *blocks):
        super().__init__(*blocks)
        self.window: list[int] = []


class WindowedPool:
    def __init__(self, full: BlockPool, window: BlockPool, width: int):
        """full: the full-attention layers' blocks; window: the sliding layers' (it needs a hole);
        width: the widest sliding window, in positions."""
        if window.hole is None or full.block_size != window.block_size:
            raise ValueError("the sliding layers' pool needs a hole and the full pool's block size")
        self.full, self.window, self.width = full, window, width
        self.block_size, self.hole = full.block_size, window.hole

    @property
    def num_blocks(self) -> int:
        return self.full.num_blocks

    @property
    def num_free(self) -> int:
        return self.full.num_free

    @property
    def num_cached(self) -> int:
        return self.full.num_cached

    @property
    def evictions(self) -> int:
        return self.full.evictions

    def blocks_for(self, tokens: int) -> int:
        return self.full.blocks_for(tokens)

    def table(self) -> WindowTable:
        return WindowTable()

    def lookup(self, names: list[bytes]) -> list[int]:
        """The full pool's cached blocks for the leading names, cut where the sliding pool lacks
        a block the first uncached position's window reads; `.window` of the result holds the
        sliding blocks (the hole before that window)."""
        hits = self.full.lookup(names)
        n = len(hits)
        while True:
            dead = self.dead_blocks(n * self.block_size)
            found = [self.window.lookup([name]) for name in names[dead:n]]
            miss = next((i for i, b in enumerate(found) if not b), None)
            if miss is None:
                break
            n = dead + miss
        out = WindowTable(hits[:n])
        out.window = [self.hole] * min(dead, n) + [b[0] for b in found]
        return out

    def dead_blocks(self, position: int) -> int:
        """Leading blocks no sliding layer reads once the next query is at `position`."""
        return max(0, (position - self.width + 1) // self.block_size)

    def fits(self, hits: list[int], tokens: int) -> bool:
        window = [b for b in getattr(hits, "window", []) if b != self.hole]
        lead = len(getattr(hits, "window", [])) - len(window)
        # the leading holes hold places without blocks: count them as held
        return self.full.fits(hits, tokens) and self.window.fits(window, tokens - lead * self.block_size)

    def share(self, table: WindowTable, blocks: list[int]) -> None:
        self.full.share(table, blocks)
        window = getattr(blocks, "window", [])
        lead = sum(b == self.hole for b in window)
        table.window.extend([self.hole] * lead)
        self.window.share(table.window, window[lead:])

    def can_grow(self, table: WindowTable, tokens: int) -> bool:
        return self.full.can_grow(table, tokens) and self.window.can_grow(table.window, tokens)

    def grow(self, table: WindowTable, tokens: int) -> bool:
        if not self.can_grow(table, tokens):
            return False
        self.full.grow(table, tokens)
        self.window.grow(table.window, tokens)
        return True

    def release(self, table: WindowTable) -> None:
        self.full.release(table)
        self.window.release(table.window)

    def free_before(self, table: WindowTable, blocks: int) -> int:
        """Only the sliding layers let go: the full-attention layers read every block."""
        return self.window.free_before(table.window, blocks)

    def trim(self, table: WindowTable, tokens: int) -> None:
        self.full.trim(table, tokens)
        self.window.trim(table.window, tokens)

    def name_at(self, table: WindowTable, i: int, name: bytes) -> None:
        self.full.name_at(table, i, name)
        if table.window[i] != self.hole:
            self.window.name(table.window[i], name)
