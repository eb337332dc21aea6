"""Sliding-window arithmetic of the page pool: which pages of a sequence no query can see any more.

With window W > 0 (every layer of the model attends only its last W keys), a query at absolute
position p reads keys j with p - W < j <= p. A sequence whose next token to compute sits at
position q (its *first query*) therefore never reads a key before q - W + 1 again, and its pages
lying wholly before that position go back to the pool while it runs:

    positions   0 ...... 15 | 16 ..... 31 | 32 ..... 47 | 48 .. 53 .        W = 20, q = 54
    page table  [    -1     |     -1      |     p7      |    p9     ]       first visible key 35
                 released     released      in window     in window (the tail, written next)

The page table keeps its length (positions stay absolute); a released slot holds RELEASED, which
the windowed kernels never load. Window 0 means full attention: nothing is ever released.
"""

from __future__ import annotations

RELEASED = -1  # a page-table slot whose page went back to the pool (wholly before the window)


def first_visible(first_query: int, window: int) -> int:
    """The first key position a query at first_query (or later) can still read."""
    return max(0, first_query - window + 1) if window > 0 else 0


def pages_before_window(first_query: int, window: int, page_size: int) -> int:
    """Leading pages every token of which lies before first_visible(first_query, window)."""
    return first_visible(first_query, window) // page_size


def max_pages_held(num_tokens: int, window: int, page_size: int, chunk: int = 1) -> int:
    """The most pages a sequence of num_tokens tokens holds at once when it computes `chunk` tokens
    per step: its window plus the chunk span W + chunk - 1 positions, which touch at most
    ceil((W + chunk - 2) / page_size) + 1 pages; never more than all its pages."""
    every = -(-num_tokens // page_size)
    if window <= 0:
        return every
    span = window + max(1, chunk) - 1
    return min(every, -(-(span - 1) // page_size) + 1)
