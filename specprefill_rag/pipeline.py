"""One request's way to the main model, written once for the engine and the gateway:
budget -> draft input -> (importance, scored by the caller) -> kept tokens -> sparse prompt.

The only step that differs is who runs the draft: the engine scores a prompt itself, the gateway in
its batched draft queue. Whether a request is compressed, with which keep policy, how importance
becomes kept chunks and what the main model then prefills are decided here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from .backends.base import SparsePrompt
from .config import AUTO, SpecPrefillConfig
from .prompt.layout import PromptLayout
from .results import KeepPolicy, Selection
from .selection import FixedRate, ImportanceMass, KeepBudget, select_kept

KeepRate = float | Literal["auto"]


@dataclass(frozen=True)
class Budget:
    """What one request asks to keep, and whether a draft runs for it.

    Attributes:
        keep_rate: the checked keep rate (the request's, else the engine's).
        max_document_tokens: cap on kept document tokens, or None.
        compressed: True when the draft runs; False sends the prompt whole.
    """

    keep_rate: KeepRate
    max_document_tokens: int | None
    compressed: bool

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

    def budget(
        self, layout: PromptLayout, keep_rate: KeepRate, max_document_tokens: int | None, enabled: bool = True
    ) -> Budget:
        """A request's budget; compressed when enabled and worth a draft: something to drop ("auto" always
        may), a long enough prompt, a backend that prefills what is kept.
        """
        whole = not isinstance(keep_rate, str) and keep_rate >= 1.0 and max_document_tokens is None
        # renumbered kept tokens are an ordinary prompt: a vLLM server without the plugin prefills them too
        unsupported = self.config.positions == "original" and not self.sparse_prefill
        short = len(layout) < self.min_prompt_tokens or layout.n_document_tokens == 0
        return Budget(keep_rate, max_document_tokens, enabled and not (whole or unsupported or short))

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
        return Selection(torch.arange(len(layout)), keep_policy=budget.policy, draft_error=draft_error)

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
        return Selection(kept, draft_ms, draft_cached_tokens, budget.policy, queue_ms, batch_size)

    def sparse_prompt(self, layout: PromptLayout, kept: torch.Tensor) -> SparsePrompt:
        """What the main model prefills: the ``[K]`` kept tokens at their original positions, or renumbered
        ``0..K-1`` with ``config.positions="contiguous"``.
        """
        if self.config.positions == "contiguous":
            return SparsePrompt.renumbered(layout.input_ids, kept)
        return SparsePrompt.kept(layout.input_ids, kept)
