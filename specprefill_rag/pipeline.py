"""One request's way to the main model, written once for the engine and the gateway:
budget -> draft input -> (importance, scored by the caller) -> kept tokens -> sparse prompt.

The only step that differs is who runs the draft: the engine scores a prompt itself, the gateway in
its batched draft queue. Whether a request is compressed, with which keep policy, how importance
becomes kept chunks and what the main model then prefills are decided here.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Literal

import torch

from .backends.base import SparsePrompt
from .config import AUTO, SpecPrefillConfig
from .prompt.layout import PromptLayout
from .results import KeepPolicy, NotCompressed, Selection
from .selection import FixedRate, ImportanceMass, KeepBudget, select_kept
from .selection.memo import RecalledSpans, SelectionMemo

KeepRate = float | Literal["auto"]
log = logging.getLogger("specprefill_rag")

# What to do about each reason a request went whole that the caller did not choose (keep_all and disabled
# are choices; a failed draft is logged where it fails). Logged once per engine, at the first such request.
FIXES: dict[NotCompressed, str] = {
    "no_documents": "no retrieved documents were found in a request, so it was prefilled whole; pass them as "
    "documents= (engine, adapters), as spec_prefill.documents or document content blocks (gateway; for context "
    "inside a system message, spec_prefill.system_context or --system-context), or wrap them with format_docs / "
    "document_prompt (docs: Finding documents)",
    "short_prompt": "a prompt of {prompt_tokens} tokens was shorter than min_prompt_tokens={floor}, the length from "
    "which this draft pays, so it was prefilled whole; set min_prompt_tokens lower to compress shorter prompts",
    "no_plugin": "the vLLM server has no SpecPrefill plugin, so prompts with positions='original' are sent whole; "
    "install specprefill-rag next to vLLM (docs: vLLM plugin) or set positions='contiguous'",
    "all_kept": "the keep budget kept every document token of a drafted prompt (documents shorter than a chunk of "
    "{chunk_size} tokens, or keep_rate='auto' found the importance spread over all of them); lower keep_rate, "
    "auto_keep_ceiling or chunk_size to drop some",
}


@dataclass(frozen=True)
class DraftCost:
    """What scoring one prompt cost (all 0 when no draft ran).

    Attributes:
        draft_ms: draft scoring time.
        cached_tokens: leading draft tokens served by the draft prefix cache.
        queue_ms: time waiting for the gateway's draft queue.
        batch_size: prompts in the draft batch it was scored in.
        document_cached_tokens: draft tokens served by the per-document draft cache.
        documents_cached: documents served by it.
    """

    draft_ms: float = 0.0
    cached_tokens: int = 0
    queue_ms: float = 0.0
    batch_size: int = 0
    document_cached_tokens: int = 0
    documents_cached: int = 0


@dataclass(frozen=True)
class Budget:
    """What one request asks to keep, and whether a draft runs for it.

    Attributes:
        keep_rate: the checked keep rate (the request's, else the engine's).
        max_document_tokens: cap on kept document tokens, or None.
        skipped: why the prompt goes whole without a draft; None when the draft runs.
    """

    keep_rate: KeepRate
    max_document_tokens: int | None
    skipped: NotCompressed | None = None

    @property
    def compressed(self) -> bool:
        """True when the draft runs; False sends the prompt whole."""
        return self.skipped is None

    @property
    def policy(self) -> KeepPolicy:
        return "auto" if self.keep_rate == AUTO else "fixed"


class Pipeline:
    """The request path of one engine: its config, whether its backend prefills sparse prompts, and the
    prompt length below which nothing is compressed (``config.min_prompt_tokens`` resolved for the pair).
    """

    def __init__(self, config: SpecPrefillConfig, sparse_prefill: bool, min_prompt_tokens: int) -> None:
        self.config = config
        self.sparse_prefill = sparse_prefill
        self.min_prompt_tokens = min_prompt_tokens
        self.memo = SelectionMemo()
        self._noticed: set[NotCompressed] = set()
        self._notice_lock = threading.Lock()

    def budget(
        self, layout: PromptLayout, keep_rate: KeepRate, max_document_tokens: int | None, enabled: bool = True
    ) -> Budget:
        """A request's budget; compressed when enabled and worth a draft: something to drop ("auto" always
        may), documents, a long enough prompt, a backend that prefills what is kept.
        """
        return Budget(keep_rate, max_document_tokens, self._skipped(layout, keep_rate, max_document_tokens, enabled))

    def _skipped(
        self, layout: PromptLayout, keep_rate: KeepRate, max_document_tokens: int | None, enabled: bool
    ) -> NotCompressed | None:
        """Why this request goes whole (the caller's choices first), or None when a draft is worth it."""
        if not enabled:
            return "disabled"
        if not isinstance(keep_rate, str) and keep_rate >= 1.0 and max_document_tokens is None:
            return "keep_all"
        if layout.n_document_tokens == 0:
            return "no_documents"
        # renumbered kept tokens are an ordinary prompt: a vLLM server without the plugin prefills them too
        if self.config.positions == "original" and not self.sparse_prefill:
            return "no_plugin"
        if len(layout) < self.min_prompt_tokens:
            return "short_prompt"
        return None

    def keep_budget(self, keep_rate: KeepRate) -> KeepBudget:
        """The selection's budget policy: ``"auto"`` is :class:`ImportanceMass` with the config's ``auto_keep_*``
        settings, a number a :class:`FixedRate`.
        """
        if keep_rate == AUTO:
            config = self.config
            return ImportanceMass(config.auto_keep_share, config.auto_keep_floor, config.auto_keep_ceiling)
        return FixedRate(float(keep_rate))

    def whole(self, layout: PromptLayout, budget: Budget, draft_error: str | None = None) -> Selection:
        """Every prompt token: the request is not compressed (or its draft failed: ``draft_error``)."""
        reason = "draft_error" if draft_error is not None else budget.skipped
        self._notice(reason, len(layout))
        return Selection(
            torch.arange(len(layout)), keep_policy=budget.policy, draft_error=draft_error, uncompressed_reason=reason
        )

    def recall(
        self, layout: PromptLayout, budget: Budget, reselect: bool | None = None, tenant: str | None = None
    ) -> RecalledSpans | None:
        """The spans of a compressed request whose kept tokens an earlier request of this engine and ``tenant``
        chose (stable selection); None when it is not compressed or asks to ``reselect`` (default:
        ``config.reselect``).
        """
        if not budget.compressed or (self.config.reselect if reselect is None else reselect):
            return None
        settings = self._selection_settings(budget)
        return self.memo.recall(layout.input_ids, layout.document_index, settings, tenant)

    def _selection_settings(self, budget: Budget) -> str:
        """Everything besides the prompt that decides which tokens a span keeps."""
        config = self.config
        auto = (config.auto_keep_share, config.auto_keep_floor, config.auto_keep_ceiling)
        return f"{budget.keep_rate}|{budget.max_document_tokens}|{config.chunk_size}|{auto}|{config.positions}"

    def select(
        self,
        layout: PromptLayout,
        budget: Budget,
        importance: torch.Tensor | None,
        cost: DraftCost | None = None,
        recalled: RecalledSpans | None = None,
    ) -> Selection:
        """The kept tokens for ``[L]`` importance (document chunks by the budget, everything else whole) and
        what scoring it cost. Spans ``recalled`` keep their earlier tokens; the budget (rate and cap) applies
        to the others, whose choice is remembered. ``importance`` may be None when every span was recalled.
        """
        candidates, cap = layout.document_index, budget.max_document_tokens
        if recalled is not None and recalled.reused:
            frozen = recalled.frozen_mask(len(layout))
            candidates = candidates.masked_fill(frozen.to(candidates.device), -1)
            if cap is not None:
                cap = max(cap - recalled.frozen_kept().numel(), 0)
        kept = select_kept(
            importance if importance is not None else torch.zeros(len(layout)),
            candidates,
            keep_rate=self.keep_budget(budget.keep_rate),
            chunk_size=self.config.chunk_size,
            max_document_tokens=cap,
        )
        if recalled is not None:
            kept = _with_recalled(kept, recalled, len(layout))
            self.memo.remember(recalled, kept)
        all_kept: NotCompressed | None = "all_kept" if kept.numel() == len(layout) else None
        self._notice(all_kept, len(layout))
        cost = cost or DraftCost()
        return Selection(
            kept,
            draft_ms=cost.draft_ms,
            draft_cached_tokens=cost.cached_tokens,
            keep_policy=budget.policy,
            queue_ms=cost.queue_ms,
            batch_size=cost.batch_size,
            uncompressed_reason=all_kept,
            reused_spans=recalled.reused if recalled is not None else 0,
            draft_document_cached_tokens=cost.document_cached_tokens,
            draft_documents_cached=cost.documents_cached,
        )

    def _notice(self, reason: NotCompressed | None, prompt_tokens: int) -> None:
        """Log the fix for ``reason`` the first time a request of this engine goes whole for it."""
        if reason not in FIXES:
            return
        with self._notice_lock:
            if reason in self._noticed:
                return
            self._noticed.add(reason)
        fix = FIXES[reason].format(
            prompt_tokens=prompt_tokens, floor=self.min_prompt_tokens, chunk_size=self.config.chunk_size
        )
        log.warning("%s (stats: uncompressed_reason=%r; logged once)", fix, reason)

    def sparse_prompt(self, layout: PromptLayout, kept: torch.Tensor, tenant: str | None = None) -> SparsePrompt:
        """What the main model prefills: the ``[K]`` kept tokens at their original positions, or renumbered
        ``0..K-1`` with ``config.positions="contiguous"``; in ``tenant``'s prefix-cache namespace.
        """
        if self.config.positions == "contiguous":
            return SparsePrompt.renumbered(layout.input_ids, kept, tenant)
        return SparsePrompt.kept(layout.input_ids, kept, tenant)


def _with_recalled(kept: torch.Tensor, recalled: RecalledSpans, length: int) -> torch.Tensor:
    """``[K]`` kept indices with the recalled spans' tokens replaced by those kept before."""
    if not recalled.reused:
        return kept
    keep = torch.zeros(length, dtype=torch.bool)
    keep[kept.cpu()] = True
    keep[recalled.frozen_mask(length)] = False
    keep[recalled.frozen_kept()] = True
    keep[-1] = True
    return torch.nonzero(keep).flatten().to(kept.device)
