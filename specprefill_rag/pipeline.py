"""One request's way to the main model, written once for the engine, the gateway and the adapters:
options -> budget -> recall -> draft input -> importance (scored by a :class:`Scorer`) -> kept tokens -> sparse prompt.

:meth:`Pipeline.plan` decides, before any model runs, whether and what the draft reads (and refuses what the client
must fix: a prompt too long for the draft, a document cache that is off); :meth:`Pipeline.choose` (or
:meth:`Pipeline.achoose` on an event loop) runs the draft through a scorer and selects the kept tokens. The only
thing that differs between callers is the scorer (the engine's :class:`InlineScorer` drafts in the caller's thread,
the gateway's queue in batches) and what a failed draft does (``on_draft_error``: the engine raises, the gateway
sends the prompt whole or answers 500).
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Literal, NoReturn, Protocol

import torch

from .backends.base import SparsePrompt
from .config import AUTO, SpecPrefillConfig
from .draft.assembly import DocumentSpans
from .draft.paths import DirectScoring, DraftInput, MappedScoring, TokenScorer, document_spans, draft_score
from .errors import InvalidRequestError
from .prompt.layout import PromptLayout
from .request import RequestOptions
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
    "which this draft pays, so it was prefilled whole: below it drafting costs more time to first token than the "
    "smaller prefill saves (measured crossovers: docs 'When SpecPrefill pays'); set min_prompt_tokens lower (0: "
    "every prompt) to compress shorter prompts anyway, or draft with fewer layers (draft='self', draft_layers)",
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


class DocumentCacheOff(InvalidRequestError):
    """A request asks for the per-document draft cache of a draft that has none (``document_cache_mb`` 0)."""

    def __init__(self) -> None:
        super().__init__(
            "draft_document_cache=True, but this draft has no per-document cache (document_cache_mb=0; a gateway: "
            "--document-cache-mb 0); build the engine with document_cache_mb above 0 (serve --document-cache-mb "
            "above 0), or leave draft_document_cache off"
        )


@dataclass(frozen=True)
class DraftPlan:
    """One request's way through the pipeline, decided before any model runs (:meth:`Pipeline.plan`).

    Attributes:
        layout: the prompt.
        options: the request's options, unset ones resolved (the engine's config).
        budget: what it keeps, and whether it is compressed.
        recalled: spans whose kept tokens an earlier request chose (stable selection), or None.
        prepared: what the draft reads; None when no draft runs (not compressed, every span recalled, or
            ``draft_error``).
        documents: the draft prompt's documents to take from the per-document cache, or None.
        draft_error: why the draft could not read this prompt, when the error policy sends it whole.
    """

    layout: PromptLayout
    options: RequestOptions
    budget: Budget
    recalled: RecalledSpans | None = None
    prepared: DraftInput | None = None
    documents: DocumentSpans | None = None
    draft_error: str | None = None


@dataclass(frozen=True)
class Drafted:
    """A scorer's answer for one prompt: ``[L_d + Q]`` importance of the draft's own tokens, and its cost."""

    importance: torch.Tensor
    cost: DraftCost


class Scorer(Protocol):
    """Runs the draft on one prepared prompt, blocking (the engine's sync path)."""

    def score(self, prepared: DraftInput, documents: DocumentSpans | None, options: RequestOptions) -> Drafted:
        """The draft's importance of ``prepared.token_ids``; ``documents``: take their KV from the per-document
        cache; ``options``: the request's (resolved) options.
        """
        ...


class AsyncScorer(Protocol):
    """Runs the draft on one prepared prompt from an event loop (the engine's async path, the gateway's queue)."""

    async def ascore(self, prepared: DraftInput, documents: DocumentSpans | None, options: RequestOptions) -> Drafted:
        """:meth:`Scorer.score`, awaited."""
        ...


@dataclass(frozen=True)
class InlineScorer:
    """The engine's scorer: the draft runs in the caller's thread (a worker thread from an event loop), on its own
    device under its model's lock.
    """

    draft: TokenScorer

    def score(self, prepared: DraftInput, documents: DocumentSpans | None, options: RequestOptions) -> Drafted:
        started = time.perf_counter()
        scored = draft_score(self.draft, prepared.token_ids, documents, options.tenant)
        cost = DraftCost(
            _milliseconds(started),
            scored.cached_tokens,
            document_cached_tokens=scored.document_cached_tokens,
            documents_cached=scored.documents_cached,
        )
        return Drafted(scored.importance, cost)

    async def ascore(self, prepared: DraftInput, documents: DocumentSpans | None, options: RequestOptions) -> Drafted:
        return await asyncio.to_thread(self.score, prepared, documents, options)


# What a failed draft does: raise, or return the ``draft_error`` text the prompt then goes whole with.
DraftErrorPolicy = Callable[[Exception], str]


def reraise(error: Exception) -> NoReturn:
    """The engine's policy: a failed draft fails the request with its own error."""
    raise error


def _milliseconds(since: float) -> float:
    return (time.perf_counter() - since) * 1000.0


class Pipeline:
    """The request path of one engine: its config, whether its backend prefills sparse prompts, the prompt
    length below which nothing is compressed (``config.min_prompt_tokens`` resolved for the pair) and how the
    draft reads a layout (``scoring``; None for a pipeline that is only given importance, :meth:`select`).
    """

    def __init__(
        self,
        config: SpecPrefillConfig,
        sparse_prefill: bool,
        min_prompt_tokens: int,
        scoring: DirectScoring | MappedScoring | None = None,
    ) -> None:
        self.config = config
        self.sparse_prefill = sparse_prefill
        self.min_prompt_tokens = min_prompt_tokens
        self.scoring = scoring
        self.defaults = RequestOptions(
            config.keep_rate, config.max_document_tokens, config.reselect, config.draft_document_cache
        )
        self.memo = SelectionMemo()
        self._noticed: set[NotCompressed] = set()
        self._notice_lock = threading.Lock()

    def resolve(self, options: RequestOptions) -> RequestOptions:
        """``options`` with each unset one taken from the config; refuses the per-document draft cache where the
        draft has none (:class:`DocumentCacheOff`).
        """
        resolved = options.over(self.defaults)
        if resolved.draft_document_cache and (self.scoring is None or self.scoring.draft.document_cache is None):
            raise DocumentCacheOff()
        return resolved

    def plan(
        self,
        layout: PromptLayout,
        options: RequestOptions,
        prepared: DraftInput | None = None,
        on_draft_error: DraftErrorPolicy = reraise,
    ) -> DraftPlan:
        """What this request does, before any model runs: its budget, the spans it recalls, and what the draft
        reads (``prepared``, when the caller already has it). A prompt too long for the draft
        (:class:`~specprefill_rag.errors.DraftContextLengthError`, ``DraftLimitError``) is refused whatever the
        policy: sending it whole would turn a compressed request into a full-cost one the client did not ask for
        (it can: ``keep_rate=1.0`` or ``enabled=False``); another failure to prepare it follows ``on_draft_error``.
        """
        options = self.resolve(options)
        rate = self.config.keep_rate if options.keep_rate is None else options.keep_rate
        budget = self.budget(layout, rate, options.max_document_tokens, options.enabled)
        recalled = self.recall(layout, budget, options.reselect, options.tenant)
        if not budget.compressed or (recalled is not None and recalled.complete):
            return DraftPlan(layout, options, budget, recalled)
        try:
            prepared = prepared or self._scoring.prepare(layout)
        except InvalidRequestError:
            raise
        except Exception as error:  # the draft cannot read it (a mapped draft's template changes the documents)
            return DraftPlan(layout, options, budget, recalled, draft_error=on_draft_error(error))
        documents = document_spans(prepared) if options.draft_document_cache else None
        return DraftPlan(layout, options, budget, recalled, prepared, documents)

    def choose(self, plan: DraftPlan, scorer: Scorer, on_draft_error: DraftErrorPolicy = reraise) -> Selection:
        """The kept tokens of a planned request, its draft run by ``scorer``; a failed draft follows
        ``on_draft_error`` (raise, or send the prompt whole with the text it returns as ``draft_error``).
        """
        if plan.prepared is None:
            return self._undrafted(plan)
        try:
            return self._drafted(plan, scorer.score(plan.prepared, plan.documents, plan.options))
        except Exception as error:  # the draft failed on this prompt: out of memory, non-finite scores...
            return self.whole(plan.layout, plan.budget, on_draft_error(error))

    async def achoose(
        self, plan: DraftPlan, scorer: AsyncScorer, on_draft_error: DraftErrorPolicy = reraise
    ) -> Selection:
        """:meth:`choose` on an event loop: the scorer is awaited (a worker thread, the gateway's queue)."""
        if plan.prepared is None:
            return self._undrafted(plan)
        try:
            drafted = await scorer.ascore(plan.prepared, plan.documents, plan.options)
            return self._drafted(plan, drafted)
        except Exception as error:  # the draft failed on this prompt: out of memory, non-finite scores...
            return self.whole(plan.layout, plan.budget, on_draft_error(error))

    def _undrafted(self, plan: DraftPlan) -> Selection:
        """A request no draft runs for: whole (not compressed, or the draft could not read it), or every span
        recalled from an earlier request.
        """
        if plan.draft_error is not None or not plan.budget.compressed:
            return self.whole(plan.layout, plan.budget, plan.draft_error)
        return self.select(plan.layout, plan.budget, None, recalled=plan.recalled)

    def _drafted(self, plan: DraftPlan, drafted: Drafted) -> Selection:
        """Selection from the draft's importance carried onto the layout (the mapping counts as draft time)."""
        assert plan.prepared is not None
        started = time.perf_counter()
        importance = self._scoring.finish(plan.prepared, drafted.importance)
        cost = replace(drafted.cost, draft_ms=drafted.cost.draft_ms + _milliseconds(started))
        return self.select(plan.layout, plan.budget, importance, cost, plan.recalled)

    @property
    def _scoring(self) -> DirectScoring | MappedScoring:
        if self.scoring is None:
            raise InvalidRequestError("this pipeline has no draft (built without scoring); pass importance to select")
        return self.scoring

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
            return "awaiting_tool_results" if layout.awaits_tool_results else "no_documents"
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
        chunks = f"{config.chunk_size}|{config.chunking}"
        return f"{budget.keep_rate}|{budget.max_document_tokens}|{chunks}|{auto}|{config.positions}"

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
            sentence_start=layout.sentence_starts() if self.config.chunking == "sentences" else None,
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

    def sparse_prompt(
        self, layout: PromptLayout, kept: torch.Tensor, options: RequestOptions | None = None
    ) -> SparsePrompt:
        """What the main model prefills: the ``[K]`` kept tokens at their original positions, or renumbered
        ``0..K-1`` with ``config.positions="contiguous"``; in the prefix-cache namespace of the request's tenant
        (``options.tenant``).
        """
        tenant = options.tenant if options is not None else None
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
