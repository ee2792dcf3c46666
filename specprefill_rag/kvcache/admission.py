"""Which entries a byte-bounded cache keeps: least recently used first out, with frequency-based admission.

A cache of per-document KV sees skewed traffic: a few documents come back often, a long tail once. Plain
least-recently-used eviction lets each one-off document push a popular one out. :class:`KeptEntries` adds
TinyLFU admission (Einziger, Friedman and Manes, 2017; the policy behind Caffeine): a :class:`FrequencySketch`
counts recent lookups of every key, held or not, and a new entry that needs room enters only if it was asked
for more often than each entry it would push out; otherwise the cache stays as it was. The counts are halved
every ``10 x`` the entries held lookups, so the cache follows a change of what is popular.

The policy works on keys and byte sizes alone (no tensors), so a benchmark can replay a workload through the
same object the cache uses.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

SAMPLE_PER_ENTRY = 10  # lookups between two halvings, per entry held (TinyLFU's W = 10 C)
MIN_SAMPLE = 160  # ... and at least this many, so a nearly empty cache does not forget at every lookup
K = TypeVar("K", bound=Hashable)
_HALF = bytes(count >> 1 for count in range(256))  # a translation table: each counter byte to its half
_MASK64 = 2**64 - 1
# Odd 64-bit multipliers, one per row (up to 8 rows): SHA-512's initial hash values (the fractional parts of the
# square roots of the first eight primes), the first forced odd.
_ROW_MULTIPLIERS = (
    0x6A09E667F3BCC909,
    0xBB67AE8584CAA73B,
    0x3C6EF372FE94F82B,
    0xA54FF53A5F1D36F1,
    0x510E527FADE682D1,
    0x9B05688C2B3E6C1F,
    0x1F83D9ABFB41BD6B,
    0x5BE0CD19137E2179,
)


def _mix64(value: int) -> int:
    """SplitMix64's finaliser: every bit of the 64-bit ``value`` reaches every bit of the result (Python's
    hash of a small int is the int itself).
    """
    value = ((value ^ (value >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    value = ((value ^ (value >> 27)) * 0x94D049BB133111EB) & _MASK64
    return value ^ (value >> 31)


class FrequencySketch:
    """Approximate lookup counts per key in fixed memory (a count-min sketch of saturating counters).

    ``depth`` rows of ``width`` byte counters, each key counted in one slot per row (the row's own hash); the
    estimate is the smallest of its slots, so a collision can only raise a key's count. Counters stop at
    ``limit``. Memory: ``depth * width`` bytes (64 KiB by default), whatever the number of keys.
    """

    def __init__(self, width: int = 2**14, depth: int = 4, limit: int = 15) -> None:
        if not 1 <= depth <= len(_ROW_MULTIPLIERS):
            raise ValueError(f"a sketch has 1 to {len(_ROW_MULTIPLIERS)} rows, not {depth}")
        self.width, self.limit = width, limit
        self.rows = [bytearray(width) for _ in range(depth)]

    def _slots(self, key: Hashable) -> list[int]:
        """One slot per row, each from the key's mixed hash times the row's own odd multiplier (multiply-shift
        hashing, scaled to ``width``): rows collide independently. Hashing ``(row, key)`` instead, as before, let
        Python's tuple hash put two keys that share a slot in one row in the same slot of most other rows (49 of 92
        pairs over 2,000 keys), so the sketch over-counted as if it had one row.
        """
        mixed = _mix64(hash(key) & _MASK64)
        multipliers = _ROW_MULTIPLIERS[: len(self.rows)]
        return [(((mixed * multiplier) & _MASK64) * self.width) >> 64 for multiplier in multipliers]

    def add(self, key: Hashable) -> None:
        """Count one lookup of ``key``."""
        for row, slot in zip(self.rows, self._slots(key)):
            if row[slot] < self.limit:
                row[slot] += 1

    def estimate(self, key: Hashable) -> int:
        """Lookups of ``key`` counted (since the halvings), never fewer than were made."""
        return min(row[slot] for row, slot in zip(self.rows, self._slots(key)))

    def halve(self) -> None:
        """Halve every count: what was popular long ago weighs half as much as what is popular now."""
        for row in self.rows:
            row[:] = row.translate(_HALF)


class KeptEntries(Generic[K]):
    """The keys a byte-bounded cache holds and their sizes, least recently used first.

    The cache calls :meth:`looked_up` on every lookup (a hit or a miss), :meth:`admit` before it stores an
    entry, and drops the keys :meth:`admit` returns. With ``admission=False`` every entry that fits in
    ``max_bytes`` is admitted and the least recently used leave (plain LRU).
    """

    def __init__(self, max_bytes: int, admission: bool = True, sketch: FrequencySketch | None = None) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self.admission = admission
        self.sketch = sketch or FrequencySketch()
        self._sizes: OrderedDict[K, int] = OrderedDict()
        self._counted = 0

    def __len__(self) -> int:
        return len(self._sizes)

    def __contains__(self, key: K) -> bool:
        return key in self._sizes

    def keys(self) -> list[K]:
        """The keys held, least recently used first."""
        return list(self._sizes)

    def looked_up(self, key: K) -> None:
        """Count a lookup of ``key``; a held key becomes the most recently used."""
        if key in self._sizes:
            self._sizes.move_to_end(key)
        self.sketch.add(key)
        self._counted += 1
        if self._counted >= max(SAMPLE_PER_ENTRY * len(self._sizes), MIN_SAMPLE):
            self.sketch.halve()
            self._counted = 0

    def admit(self, key: K, nbytes: int, evict: bool = True, always: bool = False) -> list[K] | None:
        """Take ``key`` (``nbytes``) in if it may enter: the keys dropped to make room, or None when it stays out.

        It stays out when it is larger than ``max_bytes``; when making room would drop an entry and ``evict``
        is False; or, with admission on and unless ``always``, when an entry it would push out was looked up at
        least as often. A key already held is only marked most recently used (nothing dropped).
        """
        if key in self._sizes:
            self._sizes.move_to_end(key)
            return []
        if nbytes > self.max_bytes:
            return None
        victims = self._victims(nbytes)
        if victims and not evict:
            return None
        if victims and self.admission and not always:
            wanted = self.sketch.estimate(key)
            if any(self.sketch.estimate(victim) >= wanted for victim in victims):
                return None
        for victim in victims:
            self.nbytes -= self._sizes.pop(victim)
        self._sizes[key] = nbytes
        self.nbytes += nbytes
        return victims

    def remove(self, key: K) -> None:
        """Forget ``key`` (held or not)."""
        self.nbytes -= self._sizes.pop(key, 0)

    def clear(self) -> None:
        """Forget every key held, and every lookup counted."""
        self._sizes.clear()
        self.nbytes = 0
        self.sketch = FrequencySketch(self.sketch.width, len(self.sketch.rows), self.sketch.limit)
        self._counted = 0

    def _victims(self, nbytes: int) -> list[K]:
        """The least recently used keys that must leave for ``nbytes`` more to fit."""
        victims, room = [], self.max_bytes - self.nbytes
        for key, size in self._sizes.items():
            if room >= nbytes:
                break
            victims.append(key)
            room += size
        return victims
