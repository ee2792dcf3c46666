"""Importance -> kept token indices. Pure tensor functions: no model calls, no state.

Only document tokens are candidates. They are grouped into chunks of ``chunk_size`` that never
span two documents; chunks are ranked by mean importance and the best are kept until the budget
is met. Everything else (instructions, question, chat-template scaffolding) and the last prompt
token are always kept. Paper section 3.2.3.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def document_chunks(document_index: torch.Tensor, chunk_size: int) -> torch.Tensor:
    """Chunk id of every token.

    Args:
        document_index: ``[L]`` long, the document each token belongs to, ``-1`` for non-documents.
        chunk_size: tokens per chunk; a run of one document's tokens is split from its start.

    Returns:
        ``[L]`` long: chunk id in ``0..n_chunks-1`` for document tokens, ``-1`` elsewhere. Chunk ids
        increase along the prompt; a chunk holds contiguous tokens of a single document.
    """
    is_candidate = document_index >= 0
    previous = torch.cat([document_index.new_full((1,), -1), document_index[:-1]])
    run_start = is_candidate & (document_index != previous)
    positions = torch.arange(document_index.numel(), device=document_index.device)
    run_id = torch.cumsum(run_start.long(), 0) - 1
    run_start_positions = positions[run_start]
    offset_in_run = positions - run_start_positions[run_id.clamp(min=0)] if run_start.any() else positions
    chunk_start = is_candidate & (offset_in_run % chunk_size == 0)
    chunk_id = torch.cumsum(chunk_start.long(), 0) - 1
    return torch.where(is_candidate, chunk_id, torch.full_like(chunk_id, -1))


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
) -> torch.Tensor:
    """Sorted indices of the prompt tokens the main model prefills.

    Args:
        importance: ``[L]`` float, per-token importance from the draft.
        document_index: ``[L]`` long, document of each token or ``-1``.
        keep_rate: fraction of document tokens to keep, in (0, 1], or a budget policy
            (:class:`FixedRate`, :class:`ImportanceMass`) that chooses it from the ranked chunks.
        chunk_size: chunk length in tokens.
        max_document_tokens: optional hard cap on kept document tokens.

    Returns:
        ``[K]`` long, strictly increasing: all non-document tokens, the kept document chunks and the
        last prompt token. Ties between chunks go to the earlier chunk, so the result is deterministic.
    """
    chunk_id = document_chunks(document_index, chunk_size)
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
