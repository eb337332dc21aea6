"""PrefixCache: chained keys, verification, salts, partial runs, subtree drops."""

from __future__ import annotations

from kvshare.core import PrefixCache
from kvshare.core.prefix_cache import blake2b_128, encode_tokens


def build(cache: PrefixCache, tokens: list[int], salt: bytes = b"", first_page: int = 0) -> list[int]:
    size = cache.page_size
    parent = cache.root(salt)
    pages = []
    for index in range(len(tokens) // size):
        entry = cache.register_full(parent, salt, tokens[index * size : (index + 1) * size], first_page + index)
        assert entry is not None
        pages.append(entry.page)
        parent = entry
    return pages


def test_keys_are_chained_hashlib_digests_not_python_hash() -> None:
    cache = PrefixCache(2)
    root = cache.root(b"s")
    assert root.key == blake2b_128(b"kvshare-root\0s")
    key = cache.page_key(root, b"s", [1, 2])
    assert key == blake2b_128(root.key + (1).to_bytes(4, "little") + b"s" + encode_tokens([1, 2]))
    assert len(key) == 16


def test_full_page_match_and_cap() -> None:
    cache = PrefixCache(2)
    build(cache, [1, 2, 3, 4, 5, 6], first_page=10)
    match = cache.match([1, 2, 3, 4, 5, 6], b"", max_tokens=5)
    assert [e.page for e in match.full] == [10, 11]
    assert (match.partial.page, match.partial_tokens) == (12, 1)  # type: ignore[union-attr]
    assert match.num_tokens(2) == 5
    assert cache.match([1, 2, 9, 4], b"", max_tokens=4).num_tokens(2) == 2
    assert cache.match([1, 2], b"other", max_tokens=2).num_tokens(2) == 0


def test_salt_separates_identical_tokens() -> None:
    cache = PrefixCache(2)
    build(cache, [1, 2, 3, 4], salt=b"alice", first_page=0)
    build(cache, [1, 2, 3, 4], salt=b"bob", first_page=5)
    assert [e.page for e in cache.match([1, 2, 3, 4, 0], b"alice", 4).full] == [0, 1]
    assert [e.page for e in cache.match([1, 2, 3, 4, 0], b"bob", 4).full] == [5, 6]
    assert cache.match([1, 2, 3, 4, 0], b"", 4).num_tokens(2) == 0


def test_a_forced_hash_collision_is_a_miss_never_a_wrong_page() -> None:
    cache = PrefixCache(2, hash_fn=lambda data: b"\x00" * 16)  # every key collides
    build(cache, [1, 2], first_page=0)
    assert cache.match([3, 4, 5], b"", 2).num_tokens(2) == 0  # same key, other tokens: verified miss
    assert cache.register_full(cache.root(b""), b"", [3, 4], 1) is None  # the key is taken: not registered
    assert cache.entry_of(1) is None
    page_two = cache.register_full(cache.entry_of(0), b"", [5, 6], 2)  # type: ignore[arg-type]
    assert page_two is None  # its key collides with page 0's entry, whose parent differs
    # same tokens and key one level down: page 0's KV was computed at positions 0-1, not 2-3
    assert [e.page for e in cache.match([1, 2, 1, 2, 0], b"", 4).full] == [0]
    assert cache.register_full(cache.entry_of(0), b"", [1, 2], 3) is None  # type: ignore[arg-type]
    cache.check_integrity()


def test_a_verified_duplicate_returns_the_existing_entry() -> None:
    cache = PrefixCache(2)
    (first,) = build(cache, [1, 2])
    again = cache.register_full(cache.root(b""), b"", [1, 2], 7)
    assert again is not None and again.page == first
    assert cache.entry_of(7) is None


def test_partial_pages_match_their_longest_common_run() -> None:
    cache = PrefixCache(4)
    (p0,) = build(cache, [1, 2, 3, 4])
    assert cache.register_partial(cache.entry_of(p0), b"", [5, 6, 7], 1)  # type: ignore[arg-type]
    assert cache.register_partial(cache.entry_of(p0), b"", [5, 9], 2)  # type: ignore[arg-type]
    match = cache.match([1, 2, 3, 4, 5, 6, 8, 8], b"", max_tokens=7)
    assert (match.partial.page, match.partial_tokens) == (1, 2)  # type: ignore[union-attr]
    match = cache.match([1, 2, 3, 4, 5, 9, 9], b"", max_tokens=6)
    assert (match.partial.page, match.partial_tokens) == (2, 2)  # type: ignore[union-attr]
    # a run the cache already covers is not stored twice; a longer one supersedes a shorter one
    assert not cache.register_partial(cache.entry_of(p0), b"", [5, 6], 3)  # type: ignore[arg-type]
    dropped: list[int] = []
    cache.on_drop = dropped.append
    assert cache.register_partial(cache.entry_of(p0), b"", [5, 9, 1], 3)  # type: ignore[arg-type]
    assert dropped == [2]
    cache.check_integrity()


def test_a_full_page_supersedes_partial_runs_it_covers() -> None:
    dropped: list[int] = []
    cache = PrefixCache(2, on_drop=dropped.append)
    assert cache.register_partial(cache.root(b""), b"", [1], 4)
    build(cache, [1, 2], first_page=5)
    assert dropped == [4]
    assert cache.entry_of(4) is None
    cache.check_integrity()


def test_partial_lookup_looks_at_a_bounded_number_of_siblings() -> None:
    cache = PrefixCache(4, max_partial_candidates=3)
    root = cache.root(b"")
    for page in range(6):  # six runs starting with token 1: only the 3 newest are looked at
        assert cache.register_partial(root, b"", [1, 10 + page], page)
    match = cache.match([1, 10, 0], b"", 2)  # page 0 would match 2 tokens, but it is not looked at
    assert (match.partial.page, match.partial_tokens) == (5, 1)  # type: ignore[union-attr]
    assert cache.match([1, 15, 0], b"", 2).partial_tokens == 2


def test_dropping_a_page_drops_its_subtree() -> None:
    dropped: list[int] = []
    cache = PrefixCache(2, on_drop=dropped.append)
    build(cache, [1, 2, 3, 4, 5, 6], first_page=0)
    cache.register_partial(cache.entry_of(2), b"", [7], 3)  # type: ignore[arg-type]
    build(cache, [9, 9], first_page=4)
    assert sorted(cache.drop(1)) == [1, 2, 3]
    assert sorted(dropped) == [1, 2, 3]
    assert [e.page for e in cache.match([1, 2, 3, 4, 5, 6, 7], b"", 6).full] == [0]
    assert len(cache) == 2
    cache.check_integrity()
    cache.drop(0)
    cache.drop(4)
    assert len(cache) == 0 and not cache._roots  # unique salts don't accumulate roots
    cache.check_integrity()
