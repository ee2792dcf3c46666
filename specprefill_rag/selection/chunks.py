"""Importance -> kept token indices. Pure tensor functions: no model calls, no state.

Only document tokens are candidates. They are grouped into chunks of ``chunk_size`` that never
span two documents (or, given sentence starts, into chunks of whole sentences up to ``chunk_size``
tokens); chunks are ranked by mean importance and the best are kept until the budget is met.
Everything else (instructions, question, chat-template scaffolding) and the last prompt token are
always kept. Paper section 3.2.3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def document_chunks(
    document_index: torch.Tensor, chunk_size: int, sentence_start: torch.Tensor | None = None
) -> torch.Tensor:
    """Chunk id of every token.

    Args:
        document_index: ``[L]`` long, the document each token belongs to, ``-1`` for non-documents.
        chunk_size: most tokens per chunk; without ``sentence_start`` a run of one document's tokens is split
            every ``chunk_size`` tokens from its start.
        sentence_start: ``[L]`` bool, tokens that start a sentence (``chunking="sentences"``): whole sentences
            are packed into chunks of at most ``chunk_size`` tokens (:func:`packed_chunk_starts`).

    Returns:
        ``[L]`` long: chunk id in ``0..n_chunks-1`` for document tokens, ``-1`` elsewhere. Chunk ids
        increase along the prompt; a chunk holds contiguous tokens of a single document.
    """
    is_candidate = document_index >= 0
    if sentence_start is None:
        chunk_start = is_candidate & (_offsets_in_runs(_run_starts(document_index)) % chunk_size == 0)
    else:
        chunk_start = packed_chunk_starts(document_index, sentence_start, chunk_size)
    chunk_id = torch.cumsum(chunk_start.long(), 0) - 1
    return torch.where(is_candidate, chunk_id, torch.full_like(chunk_id, -1))


def _run_starts(document_index: torch.Tensor) -> torch.Tensor:
    """``[L]`` bool: the first token of each run of one document's tokens."""
    previous = torch.cat([document_index.new_full((1,), -1), document_index[:-1]])
    return (document_index >= 0) & (document_index != previous)


def _offsets_in_runs(run_start: torch.Tensor) -> torch.Tensor:
    """``[L]`` long: each token's distance from the last ``run_start`` at or before it."""
    positions = torch.arange(run_start.numel(), device=run_start.device)
    if not run_start.any():
        return positions
    run_id = torch.cumsum(run_start.long(), 0) - 1
    return positions - positions[run_start][run_id.clamp(min=0)]


def packed_chunk_starts(document_index: torch.Tensor, sentence_start: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """``[L]`` bool: the first token of every chunk when whole sentences are packed greedily.

    A chunk takes the next sentence while it stays within ``chunk_size`` tokens; a sentence longer than
    ``chunk_size`` starts a chunk and is split every ``chunk_size`` tokens, and its last piece packs on. Each run
    of one document's tokens starts a chunk (and a sentence).

    Args:
        document_index: ``[L]`` long, document of each token or ``-1``.
        sentence_start: ``[L]`` bool, tokens that start a sentence; a sentence ends at the next sentence start,
            document run or non-document token.
    """
    run_start = _run_starts(document_index)
    segment_start = (document_index >= 0) & (sentence_start | run_start)
    starts = torch.nonzero(segment_start).flatten()
    stops = torch.nonzero(segment_start | (document_index < 0)).flatten()
    stops = torch.cat([stops, stops.new_tensor([document_index.numel()])])
    ends = stops[torch.searchsorted(stops, starts, right=True)]
    marks: list[int] = []
    filled = 0
    for start, end, new_run in zip(starts.tolist(), ends.tolist(), run_start[starts].tolist(), strict=True):
        length = end - start
        if new_run or filled + length > chunk_size:
            marks.append(start)
            filled = 0
        if length > chunk_size:
            marks.extend(range(start + chunk_size, end, chunk_size))
            filled = length - (length - 1) // chunk_size * chunk_size
        else:
            filled += length
    chunk_start = torch.zeros_like(segment_start)
    chunk_start[torch.tensor(marks, dtype=torch.long, device=segment_start.device)] = True
    return chunk_start


def chunk_means(importance: torch.Tensor, chunk_id: torch.Tensor, n_chunks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Mean importance and size of each chunk.

    Args:
        importance: ``[L]`` float.
        chunk_id: ``[L]`` long from :func:`document_chunks`.
        n_chunks: number of chunks.

    Returns:
        ``([n_chunks] float32 mean, [n_chunks] long size)``.
    """
    member = chunk_id >= 0
    ids = chunk_id[member]
    sums = torch.zeros(n_chunks, dtype=torch.float32, device=importance.device)
    sums.index_add_(0, ids, importance[member].float())
    sizes = torch.bincount(ids, minlength=n_chunks)
    return sums / sizes.clamp(min=1), sizes


def chunks_to_take(sizes_ranked: torch.Tensor, n_document_tokens: int, keep_rate: float, max_tokens: int | None) -> int:
    """How many of the best-ranked chunks to keep.

    ``keep_rate`` is met: the kept document tokens reach ``ceil(keep_rate * n_document_tokens)``,
    rounded up to whole chunks. ``max_tokens`` is a hard cap that is never exceeded. With both,
    the tighter one wins.

    Args:
        sizes_ranked: ``[n_chunks]`` long, chunk sizes in rank order (best first).
    """
    cumulative = torch.cumsum(sizes_ranked, 0)
    n_chunks = int(sizes_ranked.numel())
    target = math.ceil(keep_rate * n_document_tokens - 1e-9)
    by_rate = n_chunks if target >= n_document_tokens else int(torch.searchsorted(cumulative, target)) + 1
    by_rate = 0 if target <= 0 else min(by_rate, n_chunks)
    if max_tokens is None:
        return by_rate
    by_cap = int(torch.searchsorted(cumulative, max_tokens, right=True))
    return min(by_rate, by_cap)


@dataclass(frozen=True)
class FixedRate:
    """Keep ``rate`` of the document tokens (rounded up to whole chunks)."""

    rate: float

    def keep_rate(self, means_ranked: torch.Tensor, sizes_ranked: torch.Tensor) -> float:
        return self.rate


@dataclass(frozen=True)
class ImportanceMass:
    """``keep_rate="auto"``: the fewest best chunks that hold ``share`` of the documents' importance mass
    above the background level, kept share within ``[floor, ceiling]``.

    The background is the median chunk's mean importance: every token gets some attention, so mass is
    counted above it (a prompt whose attention is flat keeps the floor, one with a few sharp chunks
    keeps about those).
    """

    share: float
    floor: float
    ceiling: float

    def keep_rate(self, means_ranked: torch.Tensor, sizes_ranked: torch.Tensor) -> float:
        """The chosen share of document tokens, from ``[n_chunks]`` means and sizes in rank order."""
        excess = (means_ranked - means_ranked.median()).clamp(min=0) * sizes_ranked
        total = float(excess.sum())
        n_documents = int(sizes_ranked.sum())
        if total <= 0:
            return self.floor
        held = torch.cumsum(excess, 0) / total
        n_chunks = int(torch.searchsorted(held, torch.tensor(self.share, dtype=held.dtype) - 1e-6)) + 1
        rate = float(sizes_ranked[:n_chunks].sum()) / n_documents
        return min(max(rate, self.floor), self.ceiling)


KeepBudget = FixedRate | ImportanceMass


def select_kept(
    importance: torch.Tensor,
    document_index: torch.Tensor,
    *,
    keep_rate: float | KeepBudget,
    chunk_size: int,
    max_document_tokens: int | None = None,
    sentence_start: torch.Tensor | None = None,
) -> torch.Tensor:
    """Sorted indices of the prompt tokens the main model prefills.

    Args:
        importance: ``[L]`` float, per-token importance from the draft.
        document_index: ``[L]`` long, document of each token or ``-1``.
        keep_rate: fraction of document tokens to keep, in (0, 1], or a budget policy
            (:class:`FixedRate`, :class:`ImportanceMass`) that chooses it from the ranked chunks.
        chunk_size: chunk length in tokens (the most, with ``sentence_start``).
        max_document_tokens: optional hard cap on kept document tokens.
        sentence_start: optional ``[L]`` bool, tokens that start a sentence: chunks hold whole sentences where
            they fit (:func:`document_chunks`).

    Returns:
        ``[K]`` long, strictly increasing: all non-document tokens, the kept document chunks and the
        last prompt token. Ties between chunks go to the earlier chunk, so the result is deterministic.
    """
    chunk_id = document_chunks(document_index, chunk_size, sentence_start)
    n_chunks = int(chunk_id.max().item()) + 1 if chunk_id.numel() else 0
    keep = chunk_id < 0
    if n_chunks > 0:
        means, sizes = chunk_means(importance, chunk_id, n_chunks)
        ranked = torch.sort(means, descending=True, stable=True).indices
        budget = FixedRate(keep_rate) if isinstance(keep_rate, (int, float)) else keep_rate
        rate = budget.keep_rate(means[ranked], sizes[ranked])
        n_take = chunks_to_take(sizes[ranked], int(sizes.sum()), rate, max_document_tokens)
        taken = torch.zeros(n_chunks, dtype=torch.bool, device=importance.device)
        taken[ranked[:n_take]] = True
        keep |= (chunk_id >= 0) & taken[chunk_id.clamp(min=0)]
    keep[-1] = True
    return torch.nonzero(keep).flatten()
