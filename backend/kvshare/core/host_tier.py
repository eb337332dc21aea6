"""HostTier: the pinned-CPU tier below the GPU page pool (bookkeeping only; the runner moves bytes).

    GPU pool (PagePool + PrefixCache)                  HostTier (slots of a pinned host pool)
    cached page evicted ---- spill: copy page -> slot ---> key -> HostPage(slot, parent key, salt, tokens)
    admission misses on GPU -- load: copy slot -> page <--- longest run of the prompt's next keys

A full cached page that the GPU pool evicts is copied to a free host slot instead of being lost
(spill); a later prompt whose next pages are found here gets fresh GPU pages filled from the slots
(load) instead of recomputing them. Entries are verified like the prefix cache's (parent key, salt
and tokens), so a hash collision can never serve the wrong KV. When every slot is used the least
recently stored or used entry goes. A slot that a load read or a spill wrote in the current step
stays *pinned* until release_pins() (called after the runner executed the step's copies), so no
later decision of the same step can overwrite it.

With a disk tier below (core/disk_tier.py) a slot can also be *busy*: a background disk job reads it
(a write-through of a spilled page) or writes it (a *fill*: a disk page coming back). A busy slot is
never handed out again until io_done(); an entry being filled is not matchable until fill_done().

    slot states   free | held by an entry | filling (disk -> slot) | pinned empty (a load) or busy orphan
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class HostPage:
    slot: int
    parent_key: bytes
    salt: bytes
    tokens: tuple[int, ...]
    from_disk: bool = False       # filled from the disk tier (its loads count as disk hits)


class HostTier:
    def __init__(self, num_slots: int) -> None:
        if num_slots < 1:
            raise ValueError(f"num_slots must be >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._free: list[int] = list(range(num_slots - 1, -1, -1))    # pop() hands out slot 0 first
        self._entries: OrderedDict[bytes, HostPage] = OrderedDict()    # least recently used first
        self._pinned: list[int] = []                                   # slots the current step reads or writes
        self._pinned_entries: set[int] = set()                         # ... of those, slots still holding an entry
        self._filling: dict[bytes, HostPage] = {}                      # disk -> slot reads in flight (not matchable)
        self._busy: set[int] = set()                                   # slots a disk job reads or writes
        self._held: set[int] = set()                                   # slots of _entries and _filling
        self.spills_total = 0
        self.fills_total = 0
        self.loads_total = 0
        self.evictions_total = 0

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def store(self, key: bytes, parent_key: bytes, salt: bytes, tokens: Sequence[int]) -> int | None:
        """A slot to copy the page of ``key`` into, or None: already here (refreshed), or every slot
        is pinned by this step. Evicts the least recently used unpinned entry when full."""
        if key in self._entries:
            self._entries.move_to_end(key)
            return None
        if key in self._filling or (not self._free and not self._evict_one()):
            return None
        slot = self._free.pop()
        self._entries[key] = HostPage(slot, parent_key, salt, tuple(tokens))
        self._held.add(slot)
        self._pin(slot, holds_entry=True)
        self.spills_total += 1
        return slot

    def reserve_fill(self, key: bytes, parent_key: bytes, salt: bytes, tokens: Sequence[int]) -> int | None:
        """A slot for a disk page to be read into (busy until fill_done), or None: here already,
        being filled, or no slot can be freed. The entry is matchable only after fill_done(ok)."""
        if key in self._entries or key in self._filling or (not self._free and not self._evict_one()):
            return None
        slot = self._free.pop()
        self._filling[key] = HostPage(slot, parent_key, salt, tuple(tokens), from_disk=True)
        self._held.add(slot)
        self._busy.add(slot)
        self.fills_total += 1
        return slot

    def fill_done(self, key: bytes, ok: bool) -> None:
        """The disk read into key's slot finished: ok makes it a (most recently used) entry; a failed
        read (missing file, checksum) frees the slot."""
        entry = self._filling.pop(key)
        self._busy.discard(entry.slot)
        if ok:
            self._entries[key] = entry
        else:
            self._held.discard(entry.slot)
            self._free_slot(entry.slot)

    def is_filling(self, key: bytes) -> bool:
        return key in self._filling

    @property
    def num_filling(self) -> int:
        return len(self._filling)

    def mark_busy(self, slot: int) -> None:
        """A disk job reads this held slot (write-through): keep it until io_done(slot)."""
        assert slot in self._held, f"slot {slot} holds no entry"
        self._busy.add(slot)

    def io_done(self, slot: int) -> None:
        """The disk job on slot finished: free it if nothing holds or pins it any more."""
        self._busy.discard(slot)
        if slot not in self._held and slot not in self._pinned:
            self._free.append(slot)

    def match(self, keys: Sequence[bytes], parent_key: bytes, salt: bytes,
              pages: Sequence[Sequence[int]]) -> list[HostPage]:
        """The longest run keys[0..r) held here and verified: each entry's parent is the previous key
        (parent_key for the first), with this salt and these page tokens. Read-only."""
        run: list[HostPage] = []
        parent = parent_key
        for key, tokens in zip(keys, pages):
            entry = self._entries.get(key)
            if entry is None or entry.parent_key != parent or entry.salt != salt or entry.tokens != tuple(tokens):
                break
            run.append(entry)
            parent = key
        return run

    def take(self, key: bytes) -> HostPage:
        """Remove an entry whose page is being loaded back to the GPU; its slot stays pinned (the
        load has not run yet) and is free again after release_pins()."""
        entry = self._entries.pop(key)
        self._held.discard(entry.slot)
        if entry.slot in self._pinned_entries:          # spilled and loaded back in the same step
            self._pinned_entries.discard(entry.slot)
        else:
            self._pin(entry.slot, holds_entry=False)
        self.loads_total += 1
        return entry

    def release_pins(self) -> None:
        """The step's copies ran: pinned slots without an entry are free again."""
        pinned = self._pinned
        self._pinned = []
        for slot in pinned:
            if slot not in self._pinned_entries:
                self._free_slot(slot)
        self._pinned_entries.clear()

    def _pin(self, slot: int, holds_entry: bool) -> None:
        self._pinned.append(slot)
        if holds_entry:
            self._pinned_entries.add(slot)

    def _free_slot(self, slot: int) -> None:
        if slot not in self._busy:       # else io_done() frees it
            self._free.append(slot)

    def _evict_one(self) -> bool:
        """Evict the least recently used entry whose slot is neither pinned nor busy (a busy slot
        would not come free)."""
        for key, entry in self._entries.items():
            if entry.slot not in self._pinned_entries and entry.slot not in self._busy:
                del self._entries[key]
                self._held.discard(entry.slot)
                self._free.append(entry.slot)
                self.evictions_total += 1
                return True
        return False

    def check_integrity(self) -> None:
        """Every slot is exactly one of: free, holding an entry, being filled, or pinned empty by a load
        or busy with a disk job after its entry went (both wait to be freed)."""
        held = [e.slot for e in self._entries.values()]
        filling = [e.slot for e in self._filling.values()]
        waiting = sorted((set(self._pinned) - self._pinned_entries) | (self._busy - set(held) - set(filling)))
        everything = self._free + held + filling + waiting
        assert sorted(everything) == list(range(self.num_slots)), (
            f"host slots lost or doubled: free {sorted(self._free)}, held {sorted(held)}, filling {sorted(filling)}, "
            f"waiting {waiting}")
        assert set(held) | set(filling) == self._held, "held-slot set out of date"
        assert not self._busy & set(self._free), "a busy slot is free"
        assert set(filling) <= self._busy, "a slot being filled is not busy"
        assert not self._entries.keys() & self._filling.keys(), "a key both held and being filled"
        assert self._pinned_entries <= set(held), "a pinned entry slot holds no entry"
        assert len(set(self._pinned)) == len(self._pinned), "a slot pinned twice"
