"""PrefixCache: which physical page already holds the KV of a given token prefix.

Entries form one tree per cache_salt (the salt is hashed into the root, so different salts never
share). A full page's key is hash(parent key, salt, the page's token ids) with hashlib (blake2b,
16 bytes); a lookup walks the prompt page by page and accepts an entry only if it is *verified*:
same salt, same token ids, and its parent is the very entry matched one level up (object
identity). A hash collision therefore costs a miss, never wrong KV.

Partial pages: the tail page of a released sequence (fewer than page_size tokens) is kept as a
keyless entry. Both kinds are indexed under their parent by first token, so "the longest cached
run of my next tokens" is a bounded look at the newest few siblings (max_partial_candidates),
never a global scan. The manager copies those tokens into a private page (copy on write).

Dropping an entry (eviction, supersession) drops its whole subtree: a child whose parent is gone
can never be verified again, so keeping it would only waste a page. on_drop(page) tells the pool.
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass

HashFn = Callable[[bytes], bytes]


def blake2b_128(data: bytes) -> bytes:
    return hashlib.blake2b(data, digest_size=16).digest()


def encode_tokens(token_ids: Sequence[int]) -> bytes:
    encoded = array("q", token_ids)
    if sys.byteorder == "big":  # keys are little-endian everywhere, so they could be shared
        encoded.byteswap()
    return encoded.tobytes()


class PrefixNode:
    """A tree node: a salt's root or a cached page. children: first token -> entries, oldest first."""

    __slots__ = ("key", "children", "alive")

    def __init__(self, key: bytes) -> None:
        self.key = key
        self.children: dict[int, dict[CachedPage, None]] = {}
        self.alive = True


class CachedPage(PrefixNode):
    __slots__ = ("page", "tokens", "salt", "parent", "is_full", "hits")

    def __init__(
        self, key: bytes, page: int, tokens: tuple[int, ...], salt: bytes, parent: PrefixNode, is_full: bool
    ) -> None:
        super().__init__(key)
        self.page = page
        self.tokens = tokens
        self.salt = salt
        self.parent = parent
        self.is_full = is_full
        self.hits = 0           # admissions that shared this page (the host tier keeps shared pages)

    def __repr__(self) -> str:
        kind = "full" if self.is_full else "partial"
        return f"CachedPage(page={self.page}, {kind}, {len(self.tokens)} tokens)"


@dataclass(frozen=True)
class PrefixMatch:
    full: tuple[CachedPage, ...] = ()  # shared as-is (page-table entries)
    partial: CachedPage | None = None  # copy its first partial_tokens slots (copy on write)
    partial_tokens: int = 0

    def num_tokens(self, page_size: int) -> int:
        return len(self.full) * page_size + self.partial_tokens


class PrefixCache:
    def __init__(
        self,
        page_size: int,
        *,
        hash_fn: HashFn = blake2b_128,
        max_partial_candidates: int = 8,
        on_drop: Callable[[int], None] | None = None,
    ) -> None:
        self.page_size = page_size
        self.hash_fn = hash_fn
        self.max_partial_candidates = max_partial_candidates
        self.on_drop = on_drop
        self._roots: dict[bytes, PrefixNode] = {}
        self._by_key: dict[bytes, CachedPage] = {}
        self._by_page: dict[int, CachedPage] = {}

    def __len__(self) -> int:
        return len(self._by_page)

    def entry_of(self, page: int) -> CachedPage | None:
        return self._by_page.get(page)

    def root(self, salt: bytes) -> PrefixNode:
        node = self._roots.get(salt)
        if node is None:
            node = self._roots[salt] = PrefixNode(self.root_key(salt))
        return node

    def root_key(self, salt: bytes) -> bytes:
        """The key of the salt's root, whether or not the root exists yet."""
        return self.hash_fn(b"kvshare-root\0" + salt)

    def page_key(self, parent: PrefixNode, salt: bytes, tokens: Sequence[int]) -> bytes:
        return self._key(parent.key, salt, tokens)

    def keys_after(self, parent_key: bytes, salt: bytes, pages: Sequence[Sequence[int]]) -> list[bytes]:
        """The chained keys of consecutive full pages below the node whose key is parent_key. Pure."""
        keys: list[bytes] = []
        for tokens in pages:
            parent_key = self._key(parent_key, salt, tokens)
            keys.append(parent_key)
        return keys

    def _key(self, parent_key: bytes, salt: bytes, tokens: Sequence[int]) -> bytes:
        return self.hash_fn(parent_key + len(salt).to_bytes(4, "little") + salt + encode_tokens(tokens))

    def subtree(self, page: int) -> list[CachedPage]:
        """The page's entry and every entry below it, parents before children (what drop() removes)."""
        entry = self._by_page.get(page)
        if entry is None:
            return []
        out: list[CachedPage] = []
        stack: list[CachedPage] = [entry]
        while stack:
            node = stack.pop()
            out.append(node)
            for siblings in node.children.values():
                stack.extend(siblings)
        return out

    # -- lookup --------------------------------------------------------------------------------

    def match(self, token_ids: Sequence[int], salt: bytes, max_tokens: int) -> PrefixMatch:
        """Longest verified cached prefix of token_ids[:max_tokens]: full pages, then a partial run."""
        size = self.page_size
        node = self._roots.get(salt)
        if node is None or max_tokens <= 0:
            return PrefixMatch()
        full: list[CachedPage] = []
        while (len(full) + 1) * size <= max_tokens:
            start = len(full) * size
            tokens = tuple(token_ids[start : start + size])
            entry = self._by_key.get(self.page_key(node, salt, tokens))
            if entry is None or not self._verifies(entry, node, salt, tokens):
                break
            full.append(entry)
            node = entry
        start = len(full) * size
        want = token_ids[start : min(start + size, max_tokens)]
        partial, run = self._longest_child_run(node, want)
        return PrefixMatch(tuple(full), partial, run)

    # -- read-only probing (admission order) ------------------------------------------------------

    def chain_keys(self, token_ids: Sequence[int], salt: bytes, max_tokens: int) -> tuple[bytes, ...]:
        """The keys match() would look up for the full pages of token_ids[:max_tokens], in order.

        Pure (creates no root, takes no reference), so a waiting request can hash its prompt once
        and probe() it every step for the price of a few dict lookups.
        """
        size = self.page_size
        pages = [token_ids[start : start + size] for start in range(0, max_tokens - size + 1, size)]
        return tuple(self.keys_after(self.root_key(salt), salt, pages))

    def probe(self, keys: Sequence[bytes], salt: bytes) -> int:
        """How many leading keys (from chain_keys) are cached now: no references, no recency, no root.

        Dropping an entry drops its subtree, so the cached keys of one prompt are a prefix of its
        chain and a binary search finds the boundary in O(log pages). Tokens are not compared: a
        hash collision can only misjudge a request's place in the queue; admission (match())
        verifies before anything is shared.
        """
        if salt not in self._roots:
            return 0
        lo, hi = 0, len(keys)  # keys[:lo] cached, keys[hi:] not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            entry = self._by_key.get(keys[mid - 1])
            if entry is not None and entry.salt == salt:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _verifies(self, entry: CachedPage, parent: PrefixNode, salt: bytes, tokens: tuple[int, ...]) -> bool:
        return entry.alive and entry.parent is parent and entry.salt == salt and entry.tokens == tokens

    def _candidates(self, node: PrefixNode, first_token: int) -> list[CachedPage]:
        siblings = node.children.get(first_token)
        if not siblings:
            return []
        newest_first = reversed(siblings)
        return [entry for _, entry in zip(range(self.max_partial_candidates), newest_first)]

    def _longest_child_run(self, node: PrefixNode, want: Sequence[int]) -> tuple[CachedPage | None, int]:
        if not want:
            return None, 0
        best, best_run = None, 0
        for entry in self._candidates(node, want[0]):
            run = common_prefix(entry.tokens, want)
            if run > best_run:
                best, best_run = entry, run
        return best, best_run

    # -- registration --------------------------------------------------------------------------

    def register_full(
        self, parent: PrefixNode, salt: bytes, tokens: Sequence[int], page: int
    ) -> CachedPage | None:
        """Register a computed full page under parent (a root or an entry).

        Returns the entry that now stands for this content: the new one, or an existing verified
        duplicate (then `page` is not registered). Returns None when the chain cannot continue:
        the parent was dropped, or a different live entry owns the key (a hash collision).
        """
        tokens = tuple(tokens)
        assert len(tokens) == self.page_size, f"full page needs {self.page_size} tokens, got {len(tokens)}"
        if not parent.alive:
            return None
        key = self.page_key(parent, salt, tokens)
        existing = self._by_key.get(key)
        if existing is not None:
            return existing if self._verifies(existing, parent, salt, tokens) else None
        assert page not in self._by_page, f"page {page} already registered as {self._by_page[page]}"
        for older in self._candidates(parent, tokens[0]):
            if not older.is_full and tokens[: len(older.tokens)] == older.tokens:
                self.drop(older.page)  # superseded: the full page serves every run it served
        entry = CachedPage(key, page, tokens, salt, parent, is_full=True)
        self._by_key[key] = entry
        self._link(entry)
        return entry

    def register_partial(self, parent: PrefixNode, salt: bytes, tokens: Sequence[int], page: int) -> bool:
        """Keep a released tail page (1..page_size-1 computed tokens) for copy on write.

        Returns False (nothing registered) if the parent is gone or a newer sibling already covers
        these tokens.
        """
        tokens = tuple(tokens)
        assert 0 < len(tokens) < self.page_size, f"partial page needs 1..{self.page_size - 1} tokens"
        if not parent.alive:
            return False
        assert page not in self._by_page, f"page {page} already registered as {self._by_page[page]}"
        for older in self._candidates(parent, tokens[0]):
            if older.tokens[: len(tokens)] == tokens:
                return False
            if not older.is_full and tokens[: len(older.tokens)] == older.tokens:
                self.drop(older.page)
        self._link(CachedPage(b"", page, tokens, salt, parent, is_full=False))
        return True

    def _link(self, entry: CachedPage) -> None:
        if not isinstance(entry.parent, CachedPage):
            # Dropping a superseded sibling may have just removed this (then empty) root: re-file it.
            root = self._roots.setdefault(entry.salt, entry.parent)
            assert root is entry.parent, f"two roots for salt {entry.salt!r}"
        self._by_page[entry.page] = entry
        entry.parent.children.setdefault(entry.tokens[0], {})[entry] = None

    # -- removal -------------------------------------------------------------------------------

    def drop(self, page: int) -> list[int]:
        """Unregister the page's entry and its whole subtree; returns the pages dropped."""
        entry = self._by_page.get(page)
        if entry is None:
            return []
        self._unlink_from_parent(entry)
        dropped: list[int] = []
        stack: list[CachedPage] = [entry]
        while stack:
            node = stack.pop()
            node.alive = False
            for siblings in node.children.values():
                stack.extend(siblings)
            node.children = {}
            if node.is_full and self._by_key.get(node.key) is node:
                del self._by_key[node.key]
            del self._by_page[node.page]
            dropped.append(node.page)
            if self.on_drop is not None:
                self.on_drop(node.page)
        return dropped

    def _unlink_from_parent(self, entry: CachedPage) -> None:
        parent = entry.parent
        siblings = parent.children[entry.tokens[0]]
        del siblings[entry]
        if not siblings:
            del parent.children[entry.tokens[0]]
        if not isinstance(parent, CachedPage) and not parent.children:
            self._roots.pop(entry.salt, None)  # unique salts must not grow the root table forever

    # -- debugging -----------------------------------------------------------------------------

    def check_integrity(self) -> None:
        seen = 0
        stack: list[PrefixNode] = list(self._roots.values())
        for salt, root in self._roots.items():
            assert root.alive, f"root of salt {salt!r} is dead"
        while stack:
            node = stack.pop()
            for first, siblings in node.children.items():
                assert siblings, f"empty child bucket {first} under {node!r}"
                for entry in siblings:
                    seen += 1
                    assert entry.alive, f"{entry!r} is linked but dead"
                    assert entry.parent is node, f"{entry!r} is linked under a node that is not its parent"
                    assert entry.tokens[0] == first, f"{entry!r} filed under first token {first}"
                    # a placeholder of overlap scheduling (negative) must never be cached as content
                    assert min(entry.tokens) >= 0, f"{entry!r} holds a token id that is not known yet"
                    assert self._by_page.get(entry.page) is entry, f"{entry!r} missing from the page index"
                    size_ok = len(entry.tokens) == self.page_size if entry.is_full else len(entry.tokens) < self.page_size
                    assert size_ok, f"{entry!r} has a wrong token count for page_size {self.page_size}"
                    if entry.is_full:
                        assert self._by_key.get(entry.key) is entry, f"{entry!r} missing from the key index"
                        assert entry.key == self.page_key(node, entry.salt, entry.tokens), f"{entry!r}: stale key"
                    stack.append(entry)
        assert seen == len(self._by_page), f"{len(self._by_page)} entries indexed, {seen} reachable"
        n_full = sum(1 for e in self._by_page.values() if e.is_full)
        assert n_full == len(self._by_key), f"{len(self._by_key)} keys for {n_full} full entries"


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """How many leading tokens a and b share."""
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n
