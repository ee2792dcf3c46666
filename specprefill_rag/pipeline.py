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

    def select(
        self,
        layout: PromptLayout,
        budget: Budget,
        importance: torch.Tensor,
        draft_ms: float,
        draft_cached_tokens: int = 0,
        queue_ms: float = 0.0,
        batch_size: int = 0,
    ) -> Selection:
        """The kept tokens for ``[L]`` importance (document chunks by the budget, everything else whole) and
        what scoring it cost.
        """
        kept = select_kept(
            importance,
            layout.document_index,
            keep_rate=self.keep_budget(budget.keep_rate),
            chunk_size=self.config.chunk_size,
            max_document_tokens=budget.max_document_tokens,
        )
        all_kept: NotCompressed | None = "all_kept" if kept.numel() == len(layout) else None
        self._notice(all_kept, len(layout))
        return Selection(kept, draft_ms, draft_cached_tokens, budget.policy, queue_ms, batch_size, None, all_kept)

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

    def sparse_prompt(self, layout: PromptLayout, kept: torch.Tensor) -> SparsePrompt:
        """What the main model prefills: the ``[K]`` kept tokens at their original positions, or renumbered
        ``0..K-1`` with ``config.positions="contiguous"``.
        """
        if self.config.positions == "contiguous":
            return SparsePrompt.renumbered(layout.input_ids, kept)
        return SparsePrompt.kept(layout.input_ids, kept)
