"""Kept positions on the wire: run-length codec, validation, prefix-cache salt and the position map.

A compressed request sends the ``K`` kept token ids as an ordinary prompt plus, in
``SamplingParams.extra_args``, the original prompt length ``L`` and the kept positions as runs
``[start0, length0, start1, length1, ...]``. The server maps the compact index ``p`` of a token to
``kept[p]`` for ``p < K`` (prompt) and ``p + (L - K)`` after (generated tokens). Pure Python/torch: no
vLLM import here, so clients and tests use it without vLLM installed.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence

import torch

from .errors import InvalidRequestError

PROMPT_LENGTH_KEY = "specprefill_prompt_length"
RUNS_KEY = "specprefill_runs"
PROBE_KEY = "specprefill_probe"
PROBE_MARKER = "specprefill-plugin-present"  # the plugin's refusal of a probe request says this


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


def cache_salt(prompt_length: int, runs: Sequence[int]) -> str:
    """Prefix-cache salt derived from the positions: the same compact tokens at other positions
    must never share KV blocks (vLLM hashes tokens, not positions).
    """
    digest = hashlib.sha256(f"specprefill:{prompt_length}:{','.join(map(str, runs))}".encode()).hexdigest()
    return digest[:64]


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
