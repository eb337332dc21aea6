"""Eviction policies: which cached (refcount 0, reusable) page to give up when the pool runs dry.

A policy sees only page ids and four events from the PagePool:

    insert(page)   the page became evictable (its refcount dropped to 0 and it holds a cached prefix)
    remove(page)   an evictable page was revived by a prefix hit (refcount 0 -> 1)
    touch(page)    a prefix hit used the page (called before remove for cached pages, alone for active ones)
    pop_victim()   remove and return the page to evict; the policy forgets the page's history

History (LFU counts, FIFO birth order) survives remove/insert, because a page is reused by
being revived and released again; it is dropped by pop_victim and discard (the page's content
is gone). Every operation is O(1) (LRU) or O(log n) amortised (heap-based policies, whose
stale heap entries are skipped lazily and compacted when they outnumber live ones).
"""

from __future__ import annotations

import heapq
import itertools
from collections import OrderedDict
from typing import Protocol, runtime_checkable


@runtime_checkable
class EvictionPolicy(Protocol):
    name: str

    def insert(self, page: int) -> None: ...
    def remove(self, page: int) -> None: ...
    def touch(self, page: int) -> None: ...
    def pop_victim(self) -> int: ...
    def discard(self, page: int) -> None: ...
    def __len__(self) -> int: ...
    def __contains__(self, page: object) -> bool: ...
    def check_integrity(self) -> None: ...


class LRUPolicy:
    """Least recently released first. The default: a hit revives a page, so 'use' == release."""

    name = "lru"

    def __init__(self) -> None:
        self._order: OrderedDict[int, None] = OrderedDict()

    def insert(self, page: int) -> None:
        assert page not in self._order, f"lru: page {page} inserted twice"
        self._order[page] = None

    def remove(self, page: int) -> None:
        del self._order[page]

    def touch(self, page: int) -> None:
        if page in self._order:
            self._order.move_to_end(page)

    def pop_victim(self) -> int:
        if not self._order:
            raise LookupError("lru: no evictable page")
        page, _ = self._order.popitem(last=False)
        return page

    def discard(self, page: int) -> None:
        self._order.pop(page, None)

    def __len__(self) -> int:
        return len(self._order)

    def __contains__(self, page: object) -> bool:
        return page in self._order

    def check_integrity(self) -> None:
        pass


class _LazyHeapPolicy:
    """Evictable set ordered by a per-page sort key in a heap; stale entries are skipped lazily."""

    name = "abstract"

    def __init__(self) -> None:
        self._live: dict[int, int] = {}  # evictable page -> id of its one valid heap entry
        self._heap: list[tuple[tuple[int, ...], int, int]] = []  # (sort key, entry id, page)
        self._tick = itertools.count()
        self._entry_ids = itertools.count()

    def _key(self, page: int) -> tuple[int, ...]:
        raise NotImplementedError

    def _forget(self, page: int) -> None:
        """Drop the page's history (its content is gone)."""

    def _push(self, page: int) -> None:
        entry_id = next(self._entry_ids)
        self._live[page] = entry_id
        heapq.heappush(self._heap, (self._key(page), entry_id, page))
        if len(self._heap) > 2 * len(self._live) + 64:
            # Amortised O(1): each compaction drops at least as many entries as it keeps.
            self._heap = [item for item in self._heap if self._live.get(item[2]) == item[1]]
            heapq.heapify(self._heap)

    def insert(self, page: int) -> None:
        assert page not in self._live, f"{self.name}: page {page} inserted twice"
        self._push(page)

    def remove(self, page: int) -> None:
        del self._live[page]

    def pop_victim(self) -> int:
        while self._heap:
            _, entry_id, page = heapq.heappop(self._heap)
            if self._live.get(page) == entry_id:
                if self._second_chance(page):
                    continue
                del self._live[page]
                self._forget(page)
                return page
        raise LookupError(f"{self.name}: no evictable page")

    def _second_chance(self, page: int) -> bool:
        return False

    def discard(self, page: int) -> None:
        self._live.pop(page, None)
        self._forget(page)

    def __len__(self) -> int:
        return len(self._live)

    def __contains__(self, page: object) -> bool:
        return page in self._live

    def check_integrity(self) -> None:
        valid = [page for _, entry_id, page in self._heap if self._live.get(page) == entry_id]
        assert len(valid) == len(set(valid)), f"{self.name}: a page has two live heap entries"
        missing = set(self._live) - set(valid)
        assert not missing, f"{self.name}: evictable pages {sorted(missing)[:8]} have no live heap entry"


class LFUPolicy(_LazyHeapPolicy):
    """Fewest uses first (1 + prefix hits since the page was filled); ties: least recently released."""

    name = "lfu"

    def __init__(self) -> None:
        super().__init__()
        self._uses: dict[int, int] = {}

    def _key(self, page: int) -> tuple[int, ...]:
        return (self._uses.setdefault(page, 1), next(self._tick))

    def _forget(self, page: int) -> None:
        self._uses.pop(page, None)

    def touch(self, page: int) -> None:
        self._uses[page] = self._uses.get(page, 1) + 1
        if page in self._live:
            self._push(page)


class FIFOPolicy(_LazyHeapPolicy):
    """Oldest first: ordered by when the page first became cached; hits do not reorder it."""

    name = "fifo"

    def __init__(self) -> None:
        super().__init__()
        self._born: dict[int, int] = {}

    def _key(self, page: int) -> tuple[int, ...]:
        return (self._born.setdefault(page, next(self._tick)),)

    def _forget(self, page: int) -> None:
        self._born.pop(page, None)

    def touch(self, page: int) -> None:
        self._born.setdefault(page, next(self._tick))


class SecondChancePolicy(FIFOPolicy):
    """Clock / second chance: FIFO, but a page hit since it was last considered goes to the back once."""

    name = "second-chance"

    def __init__(self) -> None:
        super().__init__()
        self._referenced: set[int] = set()

    def touch(self, page: int) -> None:
        super().touch(page)
        self._referenced.add(page)

    def _second_chance(self, page: int) -> bool:
        if page not in self._referenced:
            return False
        self._referenced.discard(page)
        self._born[page] = next(self._tick)
        self._push(page)
        return True

    def _forget(self, page: int) -> None:
        super()._forget(page)
        self._referenced.discard(page)


_POLICIES: dict[str, type[LRUPolicy] | type[_LazyHeapPolicy]] = {
    "lru": LRUPolicy,
    "lfu": LFUPolicy,
    "fifo": FIFOPolicy,
    "second-chance": SecondChancePolicy,
}
POLICY_NAMES: tuple[str, ...] = tuple(_POLICIES)


def make_policy(name: str) -> EvictionPolicy:
    """Build a policy by name: 'lru' (default), 'lfu', 'fifo', 'second-chance' (alias 'clock')."""
    key = name.strip().lower().replace("_", "-")
    key = {"clock": "second-chance", "secondchance": "second-chance"}.get(key, key)
    try:
        return _POLICIES[key]()  # type: ignore[return-value]
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {', '.join(POLICY_NAMES)}"
        ) from None
