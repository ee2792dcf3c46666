"""Kept positions on the wire: run-length codec, validation, the position map, prefix-cache block keys and salt.

A compressed request sends the ``K`` kept token ids as an ordinary prompt plus, in
``SamplingParams.extra_args``, the original prompt length ``L`` and the kept positions as runs
``[start0, length0, start1, length1, ...]``. The server maps the compact index ``p`` of a token to
``kept[p]`` for ``p < K`` (prompt) and ``p + (L - K)`` after (generated tokens). Pure Python/torch: no
vLLM import here, so clients and tests use it without vLLM installed.

Prefix caching: vLLM hashes each KV block from its token ids, the previous block's hash and per-block
extra keys. The plugin adds :meth:`BlockPositions.key` to those extra keys, so two requests share a
block only where ids and original positions agree, and a compressed request shares its leading blocks
that kept every token (positions equal to the indices) with ordinary requests. A server advertises
this with :data:`POSITION_KEYED_BLOCKS` in its probe answer; for a server without it, clients send
:func:`cache_salt` (a digest of all the positions: no sharing across requests at other positions, nor
across turns).
"""

from __future__ import annotations

import bisect
import hashlib
from collections.abc import Sequence

import torch

from .errors import InvalidRequestError

PROMPT_LENGTH_KEY = "specprefill_prompt_length"
RUNS_KEY = "specprefill_runs"
PROBE_KEY = "specprefill_probe"
PROBE_MARKER = "specprefill-plugin-present"  # the plugin's refusal of a probe request says this
# ... and, from a plugin whose prefix-cache block hashes cover the positions (so no cache_salt is needed), this
POSITION_KEYED_BLOCKS = "position-keyed-blocks"
BLOCK_KEY_TAG = "specprefill_positions"  # tags the plugin's entry in vLLM's per-block extra keys


def encode_runs(kept: torch.Tensor | Sequence[int]) -> list[int]:
    """Strictly increasing positions -> flat ``[start, length, ...]`` runs of consecutive positions."""
    values = torch.as_tensor(kept, dtype=torch.long).flatten()
    if values.numel() == 0:
        return []
    breaks = torch.nonzero(values[1:] != values[:-1] + 1).flatten() + 1
    starts = torch.cat([torch.tensor([0]), breaks])
    ends = torch.cat([breaks, torch.tensor([values.numel()])])
    return torch.stack([values[starts], ends - starts], dim=1).flatten().tolist()


_LARGEST = 2**62  # positions and lengths beyond this cannot be real and would overflow int64 sums


def check_runs(runs: Sequence[int]) -> torch.Tensor:
    """Validate flat runs without expanding them: ``[R, 2]`` long ``(start, length)`` pairs.

    Raises :class:`InvalidRequestError` unless the runs are integer pairs with starts >= 0, lengths > 0
    and each run starting after the previous one ends. Cost is O(R), whatever the lengths claim, so a
    request cannot make the server allocate its claimed positions before they are counted.
    """
    integers = isinstance(runs, (list, tuple)) and all(isinstance(v, int) and not isinstance(v, bool) for v in runs)
    if not integers or len(runs) % 2:
        raise InvalidRequestError(
            f"{RUNS_KEY} must be a flat list of integer (start, length) pairs; send e.g. [0, 8, 40, 16]"
        )
    if any(abs(v) >= _LARGEST for v in runs):
        raise InvalidRequestError(f"{RUNS_KEY}: starts and lengths must be below 2**62; send the real kept positions")
    pairs = torch.tensor(list(runs), dtype=torch.long).view(-1, 2)
    if bool((pairs[:, 1] <= 0).any()) or bool((pairs[:, 0] < 0).any()):
        raise InvalidRequestError(f"{RUNS_KEY}: starts must be >= 0 and lengths > 0; send the real kept positions")
    ends = pairs[:, 0] + pairs[:, 1]
    if bool((pairs[1:, 0] < ends[:-1]).any()):
        raise InvalidRequestError(
            f"{RUNS_KEY}: kept positions must be strictly increasing; send runs in order that do not overlap"
        )
    return pairs


def decode_runs(runs: Sequence[int]) -> torch.Tensor:
    """Flat runs -> ``[K]`` long positions. Raises :class:`InvalidRequestError` on malformed runs.

    Expands to ``K`` = the sum of the run lengths: callers on a server count them first (admission).
    """
    pairs = check_runs(runs)
    starts, lengths = pairs[:, 0], pairs[:, 1]
    first_index = torch.cumsum(lengths, 0) - lengths  # index in the output of each run's first position
    offsets = torch.arange(int(lengths.sum())) - first_index.repeat_interleave(lengths)
    return starts.repeat_interleave(lengths) + offsets


def validate(
    prompt_length: int, kept: torch.Tensor, n_prompt_tokens: int, max_new_tokens: int, max_positions: int
) -> None:
    """Check a compressed request against its prompt and the model; raises :class:`InvalidRequestError`."""
    if kept.numel() != n_prompt_tokens:
        raise InvalidRequestError(f"{kept.numel()} kept positions for {n_prompt_tokens} prompt tokens; they must match")
    if n_prompt_tokens == 0 or int(kept[-1]) != prompt_length - 1:
        raise InvalidRequestError(f"the last prompt token (position {prompt_length - 1}) must be kept")
    if prompt_length + max_new_tokens > max_positions:
        raise InvalidRequestError(
            f"original prompt length {prompt_length} + max_tokens {max_new_tokens} exceeds the model's "
            f"{max_positions} positions"
        )


def cache_salt(prompt_length: int, runs: Sequence[int], namespace: str | None = None) -> str:
    """Prefix-cache salt derived from all the positions, for servers whose plugin does not key blocks
    by position (no :data:`POSITION_KEYED_BLOCKS` in the probe answer): the same compact tokens at other
    positions must never share KV blocks there (vLLM hashes tokens, not positions). With a ``namespace``
    (a tenant), the salt is that namespace's too.
    """
    text = f"specprefill:{prompt_length}:{','.join(map(str, runs))}"
    if namespace is not None:
        text += f":{namespace_salt(namespace)}"
    return hashlib.sha256(text.encode()).hexdigest()[:64]


def namespace_salt(namespace: str) -> str:
    """vLLM's ``cache_salt`` for a cache namespace (a tenant): requests with other salts never share its
    prefix-cache blocks (vLLM puts the salt in the hash of block 0, which every later block's hash chains).
    A digest, so the namespace's name does not reach the server.
    """
    return hashlib.sha256(f"specprefill-namespace:{namespace}".encode()).hexdigest()[:64]


def original_positions(compact: torch.Tensor, kept: torch.Tensor, prompt_length: int) -> torch.Tensor:
    """Map compact indices to original RoPE positions.

    Args:
        compact: ``[n]`` long compact indices (vLLM's positions: number of computed tokens + offset).
        kept: ``[K]`` long original positions of the prompt tokens.
        prompt_length: ``L``.

    Returns:
        ``[n]`` long: ``kept[p]`` where ``p < K``, else ``p + (L - K)``.
    """
    n_kept = kept.numel()
    inside = compact < n_kept
    mapped = kept[compact.clamp(max=max(n_kept - 1, 0))] if n_kept else compact
    return torch.where(inside, mapped, compact + (prompt_length - n_kept))


class BlockPositions:
    """The position map of one compressed request, parsed once, keyed per prefix-cache block.

    The map ``p -> kept[p]`` (``p < K``), ``p + (L - K)`` (after) is piecewise ``p + offset``: one
    piece per run of kept positions (adjacent runs with the same offset merged) and one for the
    generated tokens. :meth:`key` describes the original positions of a block's tokens with the
    pieces it overlaps, in O(log R + pieces in the block), so a block hash covering it covers them.

    Raises:
        InvalidRequestError: malformed runs (:func:`check_runs`).
    """

    __slots__ = ("_offsets", "_starts")

    def __init__(self, prompt_length: int, runs: Sequence[int]) -> None:
        starts: list[int] = []  # compact index where each piece begins
        offsets: list[int] = []  # original position - compact index inside the piece
        compact = 0
        for start, length in check_runs(runs).tolist():
            if not offsets or offsets[-1] != start - compact:
                starts.append(compact)
                offsets.append(start - compact)
            compact += length
        if not offsets or offsets[-1] != prompt_length - compact:  # generated tokens: p + (L - K)
            starts.append(compact)
            offsets.append(prompt_length - compact)
        self._starts, self._offsets = starts, offsets

    @property
    def identity_end(self) -> int | None:
        """Compact index of the first token whose position differs from its index (None: none does)."""
        if self._offsets[0] != 0:
            return 0
        return self._starts[1] if len(self._starts) > 1 else None

    def key(self, start: int, end: int) -> tuple[int, ...] | None:
        """The original positions of compact indices ``start..end-1``: None where they are those indices
        (the block then hashes as an ordinary request's), else flat ``(i0, q0, i1, q1, ...)``: from block
        offset ``i_j`` on, tokens sit at consecutive original positions from ``q_j``. Equal positions give
        equal keys (the pieces are canonical).
        """
        first = max(bisect.bisect_right(self._starts, start) - 1, 0)
        last = bisect.bisect_left(self._starts, end, lo=first)
        pieces = range(first, last)
        if all(self._offsets[j] == 0 for j in pieces):
            return None
        key: list[int] = []
        for j in pieces:
            begin = max(self._starts[j], start)
            key += (begin - start, begin + self._offsets[j])
        return tuple(key)
