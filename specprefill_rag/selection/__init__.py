"""Importance -> kept tokens: chunk selection (pure tensor code, :mod:`.chunks`) and, across the turns of a
conversation, the memo that keeps a span's tokens once chosen (:mod:`.memo`).
"""

from .chunks import (
    FixedRate,
    ImportanceMass,
    KeepBudget,
    chunk_means,
    chunks_to_take,
    document_chunks,
    select_kept,
)
from .memo import RecalledSpans, SelectionMemo

__all__ = [
    "FixedRate",
    "ImportanceMass",
    "KeepBudget",
    "RecalledSpans",
    "SelectionMemo",
    "chunk_means",
    "chunks_to_take",
    "document_chunks",
    "select_kept",
]
