"""What one request may ask of the draft: a cap on its prompt tokens, and running out of memory.

The draft's memory grows linearly with the prompt (its KV cache and the prefill's activations; the
per-token cost of the embedded model is measured in BENCHMARKS.md, "Resource bounds"), so a request
may send at most ``max_draft_tokens`` prompt tokens through it. A longer prompt is refused with a
:class:`~specprefill_rag.errors.DraftLimitError` before any model runs. An out-of-memory error inside
the draft becomes a :class:`~specprefill_rag.errors.DraftOutOfMemoryError` for that request only.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import DraftLimitError, DraftOutOfMemoryError
from .assembly import DocumentSpans
from .importance import DraftScore

# What allocators raise when memory runs out: CUDA (torch.OutOfMemoryError in torch >= 2.5) and Python.
_OUT_OF_MEMORY = (torch.cuda.OutOfMemoryError, MemoryError)


def draft_token_limit(context_length: int | None, max_draft_tokens: int | None, look_ahead: int) -> int | None:
    """Most prompt tokens one request may send through the draft: ``max_draft_tokens``, and never more
    than the draft's context less the ``look_ahead - 1`` tokens it decodes after the prompt (None: no limit).
    """
    context = None if context_length is None else context_length - (look_ahead - 1)
    limits = [limit for limit in (context, max_draft_tokens) if limit is not None]
    return min(limits) if limits else None


def check_draft_tokens(prompt_tokens: int, limit: int | None) -> None:
    """Raise :class:`DraftLimitError` if a prompt of ``prompt_tokens`` draft tokens exceeds ``limit``."""
    if limit is not None and prompt_tokens > limit:
        raise DraftLimitError(prompt_tokens, limit)


def score_or_out_of_memory(
    draft: Any, input_ids: torch.Tensor, documents: DocumentSpans | None = None, namespace: str | None = None
) -> DraftScore:
    """``draft.score_prompt(input_ids, documents, namespace)``: ``[L]`` ids -> ``[L]`` importance (on the draft's
    device) and the tokens its caches (``namespace``'s entries) supplied.

    Out of memory raises :class:`DraftOutOfMemoryError` outside the ``except`` block, so the error
    carries no traceback of the draft's frames and their tensors are freed before it propagates.
    """
    try:
        return draft.score_prompt(input_ids, documents, namespace)
    except _OUT_OF_MEMORY:
        pass
    if input_ids.device.type == "cuda":
        torch.cuda.empty_cache()  # hand the failed request's cached blocks back for the next one
    raise DraftOutOfMemoryError(int(input_ids.numel()), str(input_ids.device))
