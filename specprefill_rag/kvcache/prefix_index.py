"""Which cached prompts can share a long prefix with a new one, without comparing against every entry.

A prompt's ids are cut into blocks of ``block`` ids; block ``i``'s hash chains the hash before it, so
hash ``i`` names (seed, the first ``i * block`` ids) and two prompts share hash ``i`` exactly when they
share those ids (up to 64-bit hash collisions, which only ever cost a wasted comparison: callers verify
every candidate against the ids). The index keeps, per hash, the entries that pass through it and the
entries whose last full block ends there, so a lookup costs ``O(L / block)`` dictionary reads whatever
the number of entries (a linear scan of a cache holding thousands of short prompts took milliseconds).
"""

from __future__ import annotations

from collections.abc import Hashable

import torch

BLOCK_TOKENS = 16


def block_hashes(seed: Hashable, token_ids: torch.Tensor, block: int = BLOCK_TOKENS) -> list[int]:
    """``[1 + L // block]`` chained hashes of ``token_ids`` ([L] integer, CPU); element ``i`` names
    (``seed``, the first ``i * block`` ids), element 0 the seed alone.
    """
    data = token_ids.to(torch.int64).numpy().tobytes()
    step = block * 8
    hashes = [hash(seed)]
    for start in range(0, len(data) - step + 1, step):
        hashes.append(hash((hashes[-1], data[start : start + step])))
    return hashes


class PrefixIndex:
    """Entry numbers by the chained block hashes of their ids (see :func:`block_hashes`)."""

    def __init__(self) -> None:
        self._through: dict[int, set[int]] = {}  # hash -> entries whose ids start with those blocks
        self._ending: dict[int, set[int]] = {}  # hash -> entries whose last full block is that one

    def add(self, number: int, hashes: list[int]) -> None:
        for value in hashes:
            self._through.setdefault(value, set()).add(number)
        self._ending.setdefault(hashes[-1], set()).add(number)

    def remove(self, number: int, hashes: list[int]) -> None:
        for value in hashes:
            _discard(self._through, value, number)
        _discard(self._ending, hashes[-1], number)

    def deepest(self, hashes: list[int]) -> tuple[int, set[int]]:
        """``(i, entries)``: the most leading blocks ``i`` that any entry shares with ``hashes``, and those
        entries (every entry whose common prefix with the prompt is longest is among them).
        """
        low, high = 0, len(hashes) - 1  # the hashes present form a prefix of the chain: bisect its end
        if hashes[0] not in self._through:
            return 0, set()
        while low < high:
            middle = (low + high + 1) // 2
            if hashes[middle] in self._through:
                low = middle
            else:
                high = middle - 1
        return low, self._through[hashes[low]]

    def extending(self, hashes: list[int]) -> set[int]:
        """Entries that pass through every full block of ``hashes`` (candidates to start with that prompt)."""
        return self._through.get(hashes[-1], set())

    def ending_along(self, hashes: list[int]) -> set[int]:
        """Entries whose full blocks all lie on ``hashes`` (candidates to be a prefix of that prompt)."""
        found: set[int] = set()
        for value in hashes:
            found |= self._ending.get(value, set())
        return found


def _discard(table: dict[int, set[int]], key: int, number: int) -> None:
    numbers = table.get(key)
    if numbers is not None:
        numbers.discard(number)
        if not numbers:
            del table[key]
