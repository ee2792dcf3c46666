"""Stable selection: a span compressed once keeps its kept tokens in every later turn.

In a conversation or an agent loop each call resends the history and appends a little. Were every
document and tool result selected again against the new question, the kept tokens of an old span could
change and the sparse prompt of turn ``t`` would not be a prefix of turn ``t + 1``'s, so no prefix cache
of the main model could serve it. A :class:`SelectionMemo` remembers each compressed prompt with the tokens
kept of each of its spans; a later, longer prompt that starts with the whole of an earlier one (its next
turn, the next agent step, a retried turn after the same history), selected under the same keep settings,
keeps those spans' tokens. Only new spans are drafted and selected. Another question over the same
documents does not extend the earlier prompt (its question differs), so it is selected afresh, as RAG
needs.

Earlier prompts are found by chained block hashes of their ids (:mod:`specprefill_rag.kvcache.prefix_index`)
and verified id by id, within one namespace: a tenant's prompt only ever extends prompts of the same tenant
(None: the namespace of an engine used by one application). The memo is bounded in bytes (one budget for
every namespace), least recently used first out, and thread-safe.
"""

from __future__ import annotations

import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from ..kvcache.prefix_index import PrefixIndex, block_hashes
from ..prompt.layout import document_runs

# What a memo may hold: 64 MiB is ~5M prompt tokens of history (8 bytes an id, 4 a kept offset).
DEFAULT_MEMO_BYTES = 64 * 2**20
_ENTRY_OVERHEAD = 200  # bytes of Python objects per span besides its offsets

Span = tuple[int, int]


@dataclass(frozen=True)
class RecalledSpans:
    """What a memo knew of one prompt's spans.

    Attributes:
        runs: ``[S, 2]`` ``(start, end)`` of every span.
        kept: per span, the ``[k]`` offsets (within the span) kept earlier, or None for a new span.
        token_ids: ``[L]`` the prompt's ids (CPU, int64).
        hashes: their chained block hashes under the request's keep settings and namespace.
        namespace: the tenant whose earlier prompts it was compared with, and under which it is remembered.
    """

    runs: torch.Tensor
    kept: tuple[torch.Tensor | None, ...]
    token_ids: torch.Tensor
    hashes: list[int]
    namespace: str | None = None

    @property
    def reused(self) -> int:
        """Spans whose kept tokens come from the memo."""
        return sum(offsets is not None for offsets in self.kept)

    @property
    def complete(self) -> bool:
        """Every span was recalled: nothing is left to draft."""
        return self.reused == len(self.kept)

    def frozen_mask(self, length: int) -> torch.Tensor:
        """``[L]`` bool: tokens of recalled spans (not candidates of this request's selection)."""
        mask = torch.zeros(length, dtype=torch.bool)
        for (start, end), offsets in zip(self.runs.tolist(), self.kept):
            if offsets is not None:
                mask[start:end] = True
        return mask

    def frozen_kept(self) -> torch.Tensor:
        """``[k]`` sorted prompt indices kept in the recalled spans."""
        starts = self.runs[:, 0].tolist()
        parts = [offsets.long() + start for start, offsets in zip(starts, self.kept) if offsets is not None]
        return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


@dataclass
class _Entry:
    namespace: str | None
    token_ids: torch.Tensor  # [P] int64, CPU
    hashes: list[int]
    spans: dict[Span, torch.Tensor]  # (start, end) -> kept offsets within the span, int32
    nbytes: int


class SelectionMemo:
    """Compressed prompts and what each kept of its spans, least recently used first out past ``max_bytes``."""

    def __init__(self, max_bytes: int = DEFAULT_MEMO_BYTES) -> None:
        self.max_bytes = max_bytes
        self.nbytes = 0
        self._entries: OrderedDict[int, _Entry] = OrderedDict()
        self._index = PrefixIndex()
        self._numbers = itertools.count()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def recall(
        self, input_ids: torch.Tensor, document_index: torch.Tensor, settings: str, namespace: str | None = None
    ) -> RecalledSpans:
        """The spans of a prompt (``[L]`` ids and document ids) and, for those of the longest remembered prompt
        of ``namespace`` it starts with (under the same ``settings``: the keep settings), what was kept of each.
        """
        token_ids = input_ids.cpu().to(torch.int64)
        runs = document_runs(document_index.cpu())
        hashes = block_hashes((settings, namespace), token_ids)
        with self._lock:
            earlier = self._longest_within(token_ids, hashes, namespace)
            spans = earlier.spans if earlier is not None else {}
            kept = tuple(spans.get((start, end)) for start, end in runs.tolist())
        return RecalledSpans(runs, kept, token_ids, hashes, namespace)

    def remember(self, recalled: RecalledSpans, kept: torch.Tensor) -> None:
        """Store the prompt of ``recalled`` (in its namespace) with, per span, its offsets in the sorted ``[K]``
        ``kept`` indices.
        """
        kept = kept.cpu()
        spans = {}
        for start, end in recalled.runs.tolist():
            inside = kept[(kept >= start) & (kept < end)]
            spans[(start, end)] = (inside - start).to(torch.int32)
        size = recalled.token_ids.numel() * 8 + sum(o.numel() * 4 + _ENTRY_OVERHEAD for o in spans.values())
        if size > self.max_bytes:
            return
        with self._lock:
            for number in self._index.extending(recalled.hashes):
                entry = self._entries[number]
                if entry.namespace == recalled.namespace and torch.equal(entry.token_ids, recalled.token_ids):
                    self._entries.move_to_end(number)  # the same prompt again (a retry): keep the first choice
                    return
            number = next(self._numbers)
            self._entries[number] = _Entry(recalled.namespace, recalled.token_ids, recalled.hashes, spans, size)
            self._index.add(number, recalled.hashes)
            self.nbytes += size
            while self.nbytes > self.max_bytes:
                self._remove(next(iter(self._entries)))

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._index = PrefixIndex()
            self.nbytes = 0

    def _longest_within(self, token_ids: torch.Tensor, hashes: list[int], namespace: str | None) -> _Entry | None:
        """The longest remembered prompt of ``namespace`` that ``token_ids`` extend (marked most recently used).
        The same prompt again is no extension: it is drafted again (its selection is the same, to float rounding).
        """
        best, best_length = None, -1
        for number in self._index.ending_along(hashes):
            entry = self._entries[number]
            length = entry.token_ids.numel()
            mine = entry.namespace == namespace
            if mine and best_length < length < token_ids.numel() and torch.equal(token_ids[:length], entry.token_ids):
                best, best_length = number, length
        if best is None:
            return None
        self._entries.move_to_end(best)
        return self._entries[best]

    def _remove(self, number: int) -> None:
        entry = self._entries.pop(number)
        self._index.remove(number, entry.hashes)
        self.nbytes -= entry.nbytes
