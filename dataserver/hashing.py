"""splitmix64's finaliser, shared by both sides: a well-mixed 64-bit hash of an integer.

Used where a cheap, stable, seedable hash of an integer is needed: the store's keys, the
pipeline's flips, the client's rendezvous routing. One definition, so that a change to it
is a change everywhere (the store and the client never need to agree on it, but nothing
should depend on three copies staying equal)."""

from __future__ import annotations

MASK64 = (1 << 64) - 1


def mix64(x: int) -> int:
    """splitmix64's finaliser of ``x`` (taken modulo 2^64)."""
    x = (x + 0x9E3779B97F4A7C15) & MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & MASK64
    return x ^ (x >> 31)
