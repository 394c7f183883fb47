"""Which blocks a tier holds, in the order it would let them go.

A block's name stands for its whole prefix, and a lookup counts only the leading blocks found,
so a parent evicted before its child strands the child: it is still stored, but no request can
reach it. A tier therefore lets go of the least recently used block that has no resident child
(a leaf of the prefix trees it holds). Children are tracked by parent name whether or not the
parent is resident, since a lower tier often receives a child before its parent (the tier above
evicts children first). The rule is per tier: a chain longer than the tiers, streamed through
them root first, leaves fragments (a parent whose child went down is a leaf again); a view
across tiers (or of what the device still holds) would do better, and is not made here.
"""

from __future__ import annotations

from collections import OrderedDict


class PrefixLRU:
    """Names and sizes of the blocks in one tier, least recently used first."""

    def __init__(self):
        self._size: OrderedDict[bytes, int] = OrderedDict()
        self._parent: dict[bytes, bytes | None] = {}
        self._kids: dict[bytes, set[bytes]] = {}  # parent name -> resident children
        self.bytes = 0

    def __len__(self) -> int:
        return len(self._size)

    def __contains__(self, name: bytes) -> bool:
        return name in self._size

    def add(self, name: bytes, size: int, parent: bytes | None = None) -> None:
        """Hold `name` (or refresh it): most recently used now."""
        if name in self._size:
            self.remove(name)
        if parent == name:
            parent = None
        self._size[name] = size
        self._parent[name] = parent
        if parent is not None:
            self._kids.setdefault(parent, set()).add(name)
        self.bytes += size

    def touch(self, name: bytes) -> None:
        """Mark `name` most recently used (a hit)."""
        if name in self._size:
            self._size.move_to_end(name)

    def remove(self, name: bytes) -> int:
        """Forget `name`; its size (0 if it was not held)."""
        size = self._size.pop(name, None)
        if size is None:
            return 0
        parent = self._parent.pop(name)
        if parent is not None:
            kids = self._kids[parent]
            kids.discard(name)
            if not kids:
                del self._kids[parent]
        self.bytes -= size
        return size

    def parent(self, name: bytes) -> bytes | None:
        return self._parent.get(name)

    def victim(self) -> bytes | None:
        """The block to let go of next: the least recently used with no resident child (it may
        be the block just stored, when it ends the only chain); None when empty. A scan from the
        oldest: the writer thread's cost, never the engine's."""
        for name in self._size:
            if not self._kids.get(name):
                return name
        return next(iter(self._size), None)  # only a loop of parents (never from real names)


class Indexed:
    """A tier that keeps its own PrefixLRU (`self._index`): what it holds, counted from it."""

    _index: PrefixLRU

    @property
    def blocks(self) -> int:
        return len(self._index)

    @property
    def bytes(self) -> int:
        return self._index.bytes
