"""Draft importance of a main-model prompt layout, by one of three paths.

``direct``  a separate draft of the main model's vocabulary reads the layout's token ids (the paper).
``self``    the main model's own first layers read them (``draft='self'``).
``mapped``  a draft of another vocabulary reads the same content rendered with its own tokenizer and
            chat template (the layout's ``source``); its importance reaches the main tokens through
            the documents' characters (:mod:`.mapping`). Chunks and the budget are then formed
            on the main tokens as on the other paths.

Every path refuses a prompt longer than the draft's context (:class:`DraftContextLengthError`)
rather than scoring it with positions the draft was never trained on, and one longer than
``max_draft_tokens`` (:class:`DraftLimitError`: the draft's memory grows with the prompt).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch

from ..errors import DraftContextLengthError, DraftScoringError, InvalidRequestError
from ..kvcache.prefix_cache import PrefixKVCache
from ..models.loading import model_lock, same_vocabulary
from ..prompt.layout import PromptLayout, PromptSource, document_runs, instructions_end
from ..results import DraftPath
from .assembly import DocumentSpans
from .budget import check_draft_tokens, draft_token_limit, score_or_out_of_memory
from .document_cache import DocumentStore
from .importance import DraftScore
from .mapping import Reduce, map_importance

# max and mean chose the same chunks on every NIAH and SQuAD sample measured (SmolLM2-135M drafting for
# the Qwen2.5 tokenizer; BENCHMARKS.md, "Cross-tokenizer drafts"); max maps a tokenizer onto itself exactly.
DEFAULT_REDUCE: Reduce = "max"


class TokenScorer(Protocol):
    """A draft that scores token ids of its own vocabulary (:class:`~specprefill_rag.draft.model.ModelDraft`,
    :class:`~specprefill_rag.draft.model.LayerPrefixDraft`).
    """

    model: Any
    prefix_cache: PrefixKVCache | None
    document_cache: DocumentStore | None

    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[L]`` long ids -> ``[L]`` float32 importance."""
        ...

    def score_prompt(
        self, input_ids: torch.Tensor, documents: DocumentSpans | None = None, namespace: str | None = None
    ) -> DraftScore:
        """``[L]`` long ids -> importance and the leading tokens the draft's prefix cache supplied; with
        ``documents``, their KV from the per-document cache where the draft has one; ``namespace``: the tenant
        whose cache entries it may use and fills (None: shared).
        """
        ...

    def score_batch(
        self,
        prompts: list[torch.Tensor],
        documents: list[DocumentSpans | None] | None = None,
        namespaces: list[str | None] | None = None,
    ) -> list[DraftScore | DraftScoringError]:
        """Several ``[L_i]`` prompts in one forward (the gateway's batches); each its result or its own error;
        ``documents``: per prompt its documents for the per-document cache, or None; ``namespaces``: per prompt
        its cache namespace (None: all shared).
        """
        ...

    def warm(self, input_ids: torch.Tensor, documents: DocumentSpans, namespace: str | None = None) -> int:
        """Encode the ``documents`` of ``[L]`` ids into the per-document cache in ``namespace``; how many it holds
        there.
        """
        ...


def score_tokens(draft: TokenScorer, input_ids: torch.Tensor) -> torch.Tensor:
    """``[L]`` importance on the CPU, the draft run on its own device under its model's lock."""
    return draft_score(draft, input_ids).importance


def draft_score(
    draft: TokenScorer,
    input_ids: torch.Tensor,
    documents: DocumentSpans | None = None,
    namespace: str | None = None,
) -> DraftScore:
    """:func:`score_tokens`, with the tokens the draft's caches supplied (``documents``: to take from the
    per-document cache; ``namespace``: whose cache entries, None: shared).
    """
    device = next(draft.model.parameters()).device
    with model_lock(draft.model):
        scored = score_or_out_of_memory(draft, input_ids.to(device), documents, namespace)
    return replace(scored, importance=scored.importance.cpu())


def draft_score_batch(
    draft: TokenScorer,
    prompts: list[torch.Tensor],
    documents: list[DocumentSpans | None] | None = None,
    namespaces: list[str | None] | None = None,
) -> list[DraftScore | Exception]:
    """:func:`draft_score` for several ``[L_i]`` prompts in one forward (the gateway's batches): each its result or
    its own error, importance on the CPU. ``documents``: per prompt its documents for the per-document cache;
    ``namespaces``: per prompt its tenant's cache namespace (None: all shared).
    """
    device = next(draft.model.parameters()).device
    with model_lock(draft.model):
        results = draft.score_batch([p.to(device) for p in prompts], documents, namespaces)
    return [replace(r, importance=r.importance.cpu()) if isinstance(r, DraftScore) else r for r in results]


def score_layout(
    scoring: DirectScoring | MappedScoring,
    layout: PromptLayout,
    prepared: DraftInput | None = None,
    documents: bool = False,
    namespace: str | None = None,
) -> DraftScore:
    """Prepare what the draft reads (unless ``prepared``, from ``scoring.prepare(layout)``, is given), score
    it under the draft's lock, and carry it onto ``layout``. ``documents``: use the per-document draft cache;
    ``namespace``: the tenant whose cache entries the draft may use and fills (None: shared).
    """
    prepared = prepared or scoring.prepare(layout)
    spans = document_spans(prepared) if documents else None
    scored = draft_score(scoring.draft, prepared.token_ids, spans, namespace)
    return replace(scored, importance=scoring.finish(prepared, scored.importance))


def document_spans(prepared: DraftInput) -> DocumentSpans | None:
    """The documents of the draft's own prompt (``prepared.draft_layout``) and their prefix: the tokens up to the
    instructions, so labels (``Document [2] <title>``) and turn markers before a document stay out of its key.
    None (the draft reads the prompt jointly) without documents, or when the prompt opens with one (a plain
    completion without a template): there is no prefix to encode documents after.
    """
    layout = prepared.draft_layout
    spans = document_runs(layout.document_index)
    if not spans.numel() or int(spans[0, 0]) == 0:
        return None
    return DocumentSpans(spans, instructions_end(layout.roles, int(spans[0, 0])))


def warm_layout(scoring: DirectScoring | MappedScoring, layout: PromptLayout, namespace: str | None = None) -> int:
    """Encode ``layout``'s documents as the draft reads them into its per-document cache in ``namespace``, under
    the draft's lock; returns how many documents it holds there (0 when the draft has no such cache or the layout
    no documents).
    """
    prepared = scoring.prepare(layout)
    spans = document_spans(prepared)
    if spans is None or scoring.draft.document_cache is None:
        return 0
    device = next(scoring.draft.model.parameters()).device
    with model_lock(scoring.draft.model):
        return scoring.draft.warm(prepared.token_ids.to(device), spans, namespace)


def check_draft_context(
    draft_tokens: int, look_ahead: int, context_length: int | None, max_tokens: int | None = None
) -> None:
    """Raise unless ``draft_tokens`` prompt tokens and ``look_ahead - 1`` decoded ones fit the draft, and
    the prompt is within ``max_tokens`` (``max_draft_tokens``).
    """
    if context_length is not None and draft_tokens + look_ahead - 1 > context_length:
        raise DraftContextLengthError(draft_tokens, look_ahead, context_length)
    check_draft_tokens(draft_tokens, max_tokens)


@dataclass(frozen=True)
class DraftInput:
    """What the draft reads for one main layout: ``token_ids`` ``[L_d]`` of its own vocabulary, and the
    layout it was rendered as (``draft_layout``; the main layout itself on the direct path).
    """

    layout: PromptLayout
    draft_layout: PromptLayout

    @property
    def token_ids(self) -> torch.Tensor:
        """``[L_d + Q]``: the draft's prompt, then its query tokens (``PromptLayout.draft_query_ids``) if any."""
        query = self.draft_layout.draft_query_ids
        ids = self.draft_layout.input_ids
        return ids if query is None else torch.cat([ids, query.to(ids.device)])

    def prompt_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """``[L_d + Q]`` scores of :attr:`token_ids` -> ``[L_d]``, those of the draft's prompt."""
        return scores[: len(self.draft_layout)]


class _LayoutScoring:
    """What both paths share: their limit, and scoring as prepare -> draft -> finish (:func:`score_layout`).
    Subclasses are dataclasses with ``context_length``, ``look_ahead`` and ``max_tokens``.
    """

    context_length: int | None
    look_ahead: int
    max_tokens: int | None

    @property
    def token_limit(self) -> int | None:
        """Most draft prompt tokens one request may have (``max_tokens`` and the context, look-ahead off)."""
        return draft_token_limit(self.context_length, self.max_tokens, self.look_ahead)

    def importance(self, layout: PromptLayout) -> torch.Tensor:
        """``[L]`` float32 importance of the layout's tokens (0 outside documents on the mapped path)."""
        return self.score(layout).importance

    def score(
        self,
        layout: PromptLayout,
        prepared: DraftInput | None = None,
        documents: bool = False,
        namespace: str | None = None,
    ) -> DraftScore:
        """:meth:`importance`, with the leading draft tokens its prefix cache supplied; ``prepared``: this
        layout's :meth:`prepare`, when the caller already has it (the mapped path renders the prompt there);
        ``documents``: take the documents' draft KV from the per-document cache; ``namespace``: the tenant whose
        cache entries the draft may use and fills (None: shared).
        """
        return score_layout(self, layout, prepared, documents, namespace)  # type: ignore[arg-type]


@dataclass(frozen=True)
class DirectScoring(_LayoutScoring):
    """The draft reads the layout's own token ids (``direct``, or ``self`` for the main model's layers).

    Attributes:
        draft: scores ids of the main model's vocabulary.
        context_length: positions the draft supports (None: unchecked).
        look_ahead: tokens the draft decodes after the prompt, the last prompt token included.
        max_tokens: most prompt tokens one request may send through the draft (None: its context).
    """

    draft: TokenScorer
    context_length: int | None
    look_ahead: int
    max_tokens: int | None = None
    path: DraftPath = "direct"

    def prepare(self, layout: PromptLayout) -> DraftInput:
        """What the draft reads (the layout's own ids); raises if they do not fit the draft's context."""
        prepared = DraftInput(layout, layout)
        check_draft_context(prepared.token_ids.numel(), self.look_ahead, self.context_length, self.max_tokens)
        return prepared

    def finish(self, prepared: DraftInput, scores: torch.Tensor) -> torch.Tensor:
        """The draft's scores of the prompt's ``[L]`` tokens are already the layout's importance."""
        return prepared.prompt_scores(scores)


@dataclass(frozen=True)
class MappedScoring(_LayoutScoring):
    """A draft of another vocabulary reads the layout's content rendered its own way (``mapped``).

    Attributes:
        draft: scores ids of the draft's vocabulary.
        tokenizer: the draft's tokenizer (and chat template).
        context_length: positions the draft supports (None: unchecked).
        look_ahead: tokens the draft decodes after the prompt, the last prompt token included.
        max_tokens: most prompt tokens (the draft's) one request may send through it (None: its context).
        reduce: how a main token combines the draft tokens that overlap it (``max`` or ``mean``).
    """

    draft: TokenScorer
    tokenizer: Any
    context_length: int | None
    look_ahead: int
    max_tokens: int | None = None
    reduce: Reduce = DEFAULT_REDUCE
    path: DraftPath = "mapped"

    def prepare(self, layout: PromptLayout) -> DraftInput:
        """The layout rendered for the draft; raises if it does not fit the draft's context."""
        prepared = DraftInput(layout, self.draft_layout(layout))
        check_draft_context(prepared.token_ids.numel(), self.look_ahead, self.context_length, self.max_tokens)
        return prepared

    def finish(self, prepared: DraftInput, scores: torch.Tensor) -> torch.Tensor:
        """The draft's ``[L_d]`` scores carried onto the main layout's ``[L]`` tokens through the documents'
        characters.
        """
        _, draft_offsets, draft_spans = _characters(prepared.draft_layout)
        _, main_offsets, main_spans = _characters(prepared.layout)
        return map_importance(
            prepared.prompt_scores(scores),
            draft_offsets,
            draft_spans,
            main_offsets,
            prepared.layout.document_index,
            main_spans,
            self.reduce,
        )

    def draft_layout(self, layout: PromptLayout) -> PromptLayout:
        """The same content laid out for the draft; its documents' text must equal the main layout's."""
        source, _, _ = _characters(layout)
        draft_layout = source.render(self.tokenizer)
        if _document_texts(draft_layout) != _document_texts(layout):
            raise DraftScoringError(
                "the draft's rendering of the prompt holds the documents' text differently from the main model's "
                "(its chat template changes them); pass use_chat_template=False or pick a draft of the main "
                "model's vocabulary"
            )
        return draft_layout


def _characters(layout: PromptLayout) -> tuple[PromptSource, torch.Tensor, torch.Tensor]:
    """``(source, [L, 2] token offsets, [S, 2] document spans)`` of a layout built from a source."""
    source, offsets, spans = layout.source, layout.offsets, layout.document_spans
    if source is None or offsets is None or spans is None:
        raise InvalidRequestError(
            "this layout has no source to render for the draft's tokenizer (it was built by hand); a draft of "
            "another vocabulary needs layouts from engine.layout(), engine.text_layout() or chat_layout()"
        )
    return source, offsets, spans


def _document_texts(layout: PromptLayout) -> list[str]:
    return [layout.text[start:end] for start, end in _characters(layout)[2].tolist()]


def draft_scoring(
    draft: TokenScorer,
    draft_tokenizer: Any,
    main_tokenizer: Any,
    look_ahead: int,
    max_tokens: int | None = None,
    reduce: Reduce = DEFAULT_REDUCE,
) -> DirectScoring | MappedScoring:
    """The direct path when the draft shares the main model's vocabulary, else the mapped one."""
    context = getattr(draft.model.config, "max_position_embeddings", None)
    if same_vocabulary(main_tokenizer, draft_tokenizer):
        return DirectScoring(draft, context, look_ahead, max_tokens)
    return MappedScoring(draft, draft_tokenizer, context, look_ahead, max_tokens, reduce)
