"""PagePool: the fixed set of KV pages, their reference counts and the free / cached split.

Every page is in exactly one state:

    free     refcount 0, on the free list, content meaningless
    active   refcount > 0 (page-table references + copy-on-write pins)
    cached   refcount 0 but reusable (holds a registered prefix): a prefix hit revives it;
             the eviction policy may give it up when no free page is left

allocate() takes free pages first (LIFO: the most recently freed page is reused first) and
only then evicts cached pages through the policy, telling the owner of the prefix index
through on_evict so it can unregister the page. Allocation is all-or-nothing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from kvshare.core.eviction import EvictionPolicy, make_policy


class PoolExhausted(RuntimeError):
    """Not enough free + cached pages for an allocation; nothing was allocated."""


class PagePool:
    def __init__(
        self,
        num_pages: int,
        policy: EvictionPolicy | str = "lru",
        on_evict: Callable[[int], None] | None = None,
    ) -> None:
        if num_pages < 1:
            raise ValueError(f"num_pages must be >= 1, got {num_pages}")
        self.num_pages = num_pages
        self.policy: EvictionPolicy = make_policy(policy) if isinstance(policy, str) else policy
        self.on_evict = on_evict
        self.evictions_total = 0  # cached pages given up to make room (victims + orphaned descendants)
        self._refcount = [0] * num_pages
        self._reusable = [False] * num_pages
        self._is_free = [True] * num_pages
        self._free = list(range(num_pages - 1, -1, -1))  # a stack: pops 0, 1, 2, ... first

    # -- counts (O(1)) -------------------------------------------------------------------------

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self.policy)

    @property
    def num_active(self) -> int:
        return self.num_pages - self.num_free - self.num_cached

    @property
    def num_allocatable(self) -> int:
        return self.num_free + self.num_cached

    def refcount(self, page: int) -> int:
        return self._refcount[page]

    def is_cached(self, page: int) -> bool:
        return self._refcount[page] == 0 and self._reusable[page]

    def is_reusable(self, page: int) -> bool:
        return self._reusable[page]

    # -- transitions ---------------------------------------------------------------------------

    def allocate(self, n: int) -> list[int]:
        """Return n pages with refcount 1; raise PoolExhausted (changing nothing) if they don't fit."""
        if n > self.num_allocatable:
            raise PoolExhausted(
                f"need {n} pages, only {self.num_free} free + {self.num_cached} cached"
            )
        pages: list[int] = []
        while len(pages) < n:
            if not self._free:
                self._evict_one()
                continue
            page = self._free.pop()
            self._is_free[page] = False
            self._refcount[page] = 1
            pages.append(page)
        return pages

    def retain(self, page: int) -> None:
        """Add a reference; revives a cached page (it leaves the evictable set)."""
        self._check_page(page)
        assert not self._is_free[page], f"retain of free page {page}"
        if self._refcount[page] == 0:
            self.policy.remove(page)
        self._refcount[page] += 1

    def touch(self, page: int) -> None:
        """Record a prefix hit on a reusable page (recency / frequency for the policy)."""
        self.policy.touch(page)

    def release(self, page: int) -> None:
        """Drop a reference; at 0 the page becomes cached if reusable, else free."""
        self._check_page(page)
        count = self._refcount[page]
        assert count > 0, f"release of page {page} whose refcount is already 0 (double free)"
        self._refcount[page] = count - 1
        if count == 1:
            if self._reusable[page]:
                self.policy.insert(page)
            else:
                self._push_free(page)

    def release_all(self, pages: Iterable[int]) -> None:
        for page in pages:
            self.release(page)

    def mark_reusable(self, page: int) -> None:
        """The page now holds a registered prefix: at refcount 0 it stays cached instead of free."""
        assert self._refcount[page] > 0, f"mark_reusable of unreferenced page {page}"
        self._reusable[page] = True

    def unmark_reusable(self, page: int) -> None:
        """The page's prefix was unregistered (not by eviction): free it now if nobody holds it."""
        if not self._reusable[page]:
            return
        self._reusable[page] = False
        if self._refcount[page] == 0:
            self.policy.remove(page)
            self._push_free(page)
        self.policy.discard(page)

    # -- internals -----------------------------------------------------------------------------

    def _evict_one(self) -> None:
        free_before = len(self._free)
        page = self.policy.pop_victim()
        self._reusable[page] = False
        self._push_free(page)
        if self.on_evict is not None:
            self.on_evict(page)  # may unmark_reusable() cached descendants, which frees them too
        self.evictions_total += len(self._free) - free_before

    def _push_free(self, page: int) -> None:
        assert not self._is_free[page], f"page {page} freed twice"
        self._is_free[page] = True
        self._free.append(page)

    def _check_page(self, page: int) -> None:
        if not 0 <= page < self.num_pages:
            raise IndexError(f"page id {page} outside 0..{self.num_pages - 1}")

    # -- debugging -----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """O(num_pages): raise AssertionError naming the first broken invariant."""
        free = self._free
        assert len(set(free)) == len(free), f"free list holds duplicates: {_dupes(free)}"
        self.policy.check_integrity()
        for page in range(self.num_pages):
            count, on_free_list = self._refcount[page], self._is_free[page]
            in_policy = page in self.policy
            assert count >= 0, f"page {page}: negative refcount {count}"
            if on_free_list:
                assert count == 0, f"page {page}: free but refcount {count}"
                assert not self._reusable[page], f"page {page}: free but still marked reusable"
                assert not in_policy, f"page {page}: both free and cached"
            elif count == 0:
                assert self._reusable[page], f"page {page}: refcount 0, not free, not reusable (leaked)"
                assert in_policy, f"page {page}: cached but unknown to the {self.policy.name} policy"
            else:
                assert not in_policy, f"page {page}: refcount {count} but still evictable"
        n_flagged = sum(self._is_free)
        assert n_flagged == len(free), f"{n_flagged} pages flagged free, free list has {len(free)}"
        total = self.num_free + self.num_active + self.num_cached
        assert total == self.num_pages, f"free+active+cached={total} != total {self.num_pages}"

    def describe(self) -> str:
        return (
            f"pages total={self.num_pages} free={self.num_free} active={self.num_active} "
            f"cached={self.num_cached} evictions={self.evictions_total} policy={self.policy.name}"
        )


def _dupes(pages: list[int]) -> list[int]:
    seen: set[int] = set()
    return sorted({p for p in pages if p in seen or seen.add(p)})[:8]  # type: ignore[func-returns-value]
