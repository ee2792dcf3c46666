"""Drafts that score a prompt: a separate small model with its look-ahead (:class:`ModelDraft`, the paper's) or
a model's first layers scoring with the prompt's last tokens (:class:`LayerPrefixDraft`).

A layer-prefix draft is the main model's own for ``draft="self"``, or a separate draft's, whole or cut, for
``draft_queries="window"`` or ``draft_layers`` (:func:`separate_draft` picks).

A draft cut after ``n`` layers has no output to decode look-ahead tokens from (its last hidden state never
reaches the LM head, and a head read off layer ``n``, a logit lens, is what small models are worst at); so it
scores with the last ``query_window`` prompt tokens as queries, each seeing the prompt up to itself, as
``self`` always has. The question and the template around it sit there, which is where the look-ahead's
first query (the last prompt token) comes from too.

With a :class:`~specprefill_rag.kvcache.prefix_cache.PrefixKVCache`, a prompt that starts like one
scored before starts from that prefix's cached keys and values: the draft prefills only the remainder,
whose queries still attend over every prompt key
(:func:`~specprefill_rag.draft.hooks.attention_after_cached_keys`), so the scores are those of a cold run.
With a per-document store (:mod:`.document_cache`) and the prompt's document spans, the prompt's KV is
instead assembled from documents drafted once each (:mod:`.assembly`): an approximation, repaired by
:mod:`.repair`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Protocol

import torch

from ..config import DraftQueries
from ..errors import DraftScoringError, InvalidRequestError
from ..kvcache.prefix_cache import DraftIdentity, PrefixKVCache, PrefixReuse
from .assembly import DocumentSpans, assemble_prompt_kv, encode_documents, held_documents
from .batch import score_model_batch, score_window_batch
from .document_cache import DocumentStore
from .hooks import (
    StopForward,
    capture_attention,
    decoder_layers,
    query_observer,
    stop_after_layers,
)
from .importance import DraftScore, ImportanceAccumulator
from .repair import DEFAULT_REPAIR, DocumentRepair


def _step_inputs(token_ids: torch.Tensor, first_position: int) -> dict[str, torch.Tensor]:
    positions = torch.arange(first_position, first_position + token_ids.numel(), device=token_ids.device)
    return {"input_ids": token_ids.view(1, -1), "position_ids": positions.view(1, -1), "cache_position": positions}


@dataclass
class ModelDraft:
    """A separate small draft model sharing the main model's tokenizer (the paper's setting).

    Queries are the last prompt token plus ``look_ahead - 1`` greedily decoded draft tokens; decoding
    stops early at an end-of-sequence token. With a ``prefix_cache``, a prompt that starts like one
    scored before prefills only its remainder (at least the last token, whose query is scored). With a
    ``document_cache``, prompts scored with their document spans take the documents' KV from it.
    """

    model: Any  # a transformers PreTrainedModel (nn.Module's attribute types hide its config)
    look_ahead: int = 8
    pool_kernel: int = 13
    eos_token_ids: frozenset[int] = field(default_factory=frozenset)
    prefix_cache: PrefixKVCache | None = None
    document_cache: DocumentStore | None = None
    repair: DocumentRepair = DEFAULT_REPAIR  # what of the cached documents is computed again in context

    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[L]`` long prompt ids -> ``[L]`` float32 importance."""
        return self.score_prompt(input_ids).importance

    @torch.inference_mode()
    def score_prompt(
        self, input_ids: torch.Tensor, documents: DocumentSpans | None = None, namespace: str | None = None
    ) -> DraftScore:
        """``[L]`` long prompt ids -> importance and how many prompt tokens the prefix cache supplied.

        ``documents``: where the prompt's documents are, to take their KV from the per-document
        cache (``document_cache``; an approximation, repaired by ``repair``: see :mod:`.assembly`); None:
        drafted jointly. ``namespace``: the tenant whose cache entries it may use and fills (None: shared).
        """
        if documents is not None and self.document_cache is not None and documents.spans.numel():
            return self._score_with_documents(input_ids, documents, self.document_cache, namespace)
        prompt_length = input_ids.numel()
        layers = self.model.config.num_hidden_layers
        reuse = PrefixReuse.begin(
            self.prefix_cache,
            self.model,
            layers,
            input_ids,
            prompt_length - 1,
            needs_past=self.look_ahead > 1,
            namespace=namespace,
        )
        importance = self._score_from(input_ids, reuse.past, reuse.cached_tokens)
        reuse.remember(input_ids)
        return DraftScore(importance, reuse.cached_tokens)

    def _score_with_documents(
        self, input_ids: torch.Tensor, documents: DocumentSpans, store: DocumentStore, namespace: str | None
    ) -> DraftScore:
        """Score from KV assembled out of the per-document cache; never stored in the (exact) prefix cache."""
        draft = DraftIdentity.of(self.model, self.model.config.num_hidden_layers)
        assembled = assemble_prompt_kv(self.model, draft, input_ids, documents, store, self.repair, namespace=namespace)
        importance = self._score_from(input_ids, assembled.past, input_ids.numel() - 1)
        return DraftScore(importance, 0, assembled.cached_tokens, assembled.documents_cached)

    def _score_from(self, input_ids: torch.Tensor, cache: Any, start: int) -> torch.Tensor:
        """``[L]`` importance: the prompt from token ``start`` on (``cache`` holds the KV before it), then the
        look-ahead, every query scored over all prompt keys.
        """
        prompt_length = input_ids.numel()
        accumulator = ImportanceAccumulator(prompt_length, self.look_ahead, input_ids.device)
        with capture_attention(self.model, accumulator, self.pool_kernel):
            inputs = _step_inputs(input_ids[start:], start)
            output = self.model(**inputs, past_key_values=cache, use_cache=cache is not None, logits_to_keep=1)
            for step in range(1, self.look_ahead):
                token = output.logits[0, -1].argmax()
                if int(token) in self.eos_token_ids:
                    break
                accumulator.step = step
                inputs = _step_inputs(token.view(1), prompt_length + step - 1)
                output = self.model(**inputs, past_key_values=cache, use_cache=True, logits_to_keep=1)
        return accumulator.result()

    def score_batch(
        self,
        prompts: list[torch.Tensor],
        documents: list[DocumentSpans | None] | None = None,
        namespaces: list[str | None] | None = None,
    ) -> list[DraftScore | DraftScoringError]:
        """Several ``[L_i]`` prompts in one batched forward (:mod:`specprefill_rag.draft.batch`); per prompt
        its ``[L_i]`` importance, equal to :meth:`score`'s within float tolerance, or its own error.
        ``namespaces``: per prompt the tenant whose cache entries it may use and fills (None: all shared).

        Prompts the prefix cache can serve, and those with ``documents`` (their KV from the
        per-document cache), are scored alone (only what is not cached is computed, which is cheaper than a
        padded row); the rest share one forward (batched rows neither read nor fill a cache).
        """
        limit = self.model.config.num_hidden_layers, 1
        return _score_batched(self, prompts, documents, namespaces, limit, partial(score_model_batch, self))

    def warm(self, input_ids: torch.Tensor, documents: DocumentSpans, namespace: str | None = None) -> int:
        """Encode the ``documents`` of the ``[L]`` prompt into the per-document cache (after their prefix) in
        ``namespace``, without scoring and without dropping any entry it holds; returns how many documents it holds
        there for this prompt (0 without a cache; fewer than asked when the rest had no room).
        """
        layers = self.model.config.num_hidden_layers
        return _warm(self.model, layers, self.document_cache, input_ids, documents, namespace)


@dataclass
class LayerPrefixDraft:
    """The first ``n_layers`` of a model, all of them included: the main model's own for ``self:<n>`` (weights
    shared; for users without a smaller sibling model), a separate draft's for ``draft_layers`` and
    ``draft_queries="window"``.

    The forward pass stops after layer ``n_layers`` (or decodes nothing when it runs them all), so no
    look-ahead token is decoded; the queries are instead the last ``query_window`` prompt tokens
    (the question and the template around it), each seeing the prompt up to itself. With a
    ``prefix_cache``, at most ``L - query_window`` leading tokens are reused, so every query is computed.
    """

    model: Any  # a transformers PreTrainedModel (nn.Module's attribute types hide its config)
    n_layers: int
    pool_kernel: int = 13
    query_window: int = 1
    prefix_cache: PrefixKVCache | None = None
    document_cache: DocumentStore | None = None
    repair: DocumentRepair = DEFAULT_REPAIR  # what of the cached documents is computed again in context

    def score(self, input_ids: torch.Tensor) -> torch.Tensor:
        """``[L]`` long prompt ids -> ``[L]`` float32 importance."""
        return self.score_prompt(input_ids).importance

    @torch.inference_mode()
    def score_prompt(
        self, input_ids: torch.Tensor, documents: DocumentSpans | None = None, namespace: str | None = None
    ) -> DraftScore:
        """``[L]`` long prompt ids -> importance and how many prompt tokens the prefix cache supplied.

        ``documents``: the documents whose KV (the first ``n_layers`` layers) comes from the per-document
        cache (``document_cache``; documents reaching into the query window are computed); None: jointly.
        ``namespace``: the tenant whose cache entries it may use and fills (None: shared).
        """
        window = min(self.query_window, input_ids.numel())
        accumulator = ImportanceAccumulator(input_ids.numel(), window, input_ids.device)
        if documents is not None and self.document_cache is not None and documents.spans.numel():
            return self._score_with_documents(input_ids, documents, self.document_cache, accumulator, window, namespace)
        reuse = PrefixReuse.begin(
            self.prefix_cache,
            self.model,
            self.n_layers,
            input_ids,
            input_ids.numel() - window,
            needs_past=False,
            namespace=namespace,
        )
        cache, start = reuse.past, reuse.cached_tokens
        capture = capture_attention(self.model, accumulator, self.pool_kernel, window)
        with capture, stop_after_layers(self.model, self.n_layers):
            try:
                inputs = _step_inputs(input_ids[start:], start)
                self.model(**inputs, past_key_values=cache, use_cache=cache is not None, logits_to_keep=1)
            except StopForward:
                pass
        importance = accumulator.result()
        reuse.remember(input_ids)
        return DraftScore(importance, start)

    def _score_with_documents(
        self,
        input_ids: torch.Tensor,
        documents: DocumentSpans,
        store: DocumentStore,
        accumulator: ImportanceAccumulator,
        window: int,
        namespace: str | None,
    ) -> DraftScore:
        """Score the last ``window`` tokens as queries inside the assembly's fresh forward (it runs them after the
        tokens the store did not supply), so the window costs no pass of its own; never stored in the (exact) prefix
        cache.
        """
        draft = DraftIdentity.of(self.model, self.n_layers)
        observe = query_observer(accumulator, self.pool_kernel, window)
        until = input_ids.numel() - window
        assembled = assemble_prompt_kv(
            self.model, draft, input_ids, documents, store, self.repair, until, namespace, observe
        )
        return DraftScore(accumulator.result(), 0, assembled.cached_tokens, assembled.documents_cached)

    def warm(self, input_ids: torch.Tensor, documents: DocumentSpans, namespace: str | None = None) -> int:
        """Encode the ``documents`` of the ``[L]`` prompt into the per-document cache (its first ``n_layers``
        layers) in ``namespace``, without scoring and without dropping any entry it holds; returns how many documents
        it holds there for this prompt.
        """
        return _warm(self.model, self.n_layers, self.document_cache, input_ids, documents, namespace)

    def score_batch(
        self,
        prompts: list[torch.Tensor],
        documents: list[DocumentSpans | None] | None = None,
        namespaces: list[str | None] | None = None,
    ) -> list[DraftScore | DraftScoringError]:
        """Several ``[L_i]`` prompts in one forward (:func:`~specprefill_rag.draft.batch.score_window_batch`); per
        prompt its ``[L_i]`` importance, equal to :meth:`score`'s within float tolerance, or its own error. As for
        :meth:`ModelDraft.score_batch`, prompts the prefix cache can serve and those with ``documents`` are scored
        alone; ``namespaces``: per prompt the tenant whose cache entries it may use (None: all shared).
        """
        limit = self.n_layers, self.query_window
        return _score_batched(self, prompts, documents, namespaces, limit, partial(score_window_batch, self))


def separate_draft(
    model: Any,
    look_ahead: int,
    pool_kernel: int,
    eos_token_ids: frozenset[int],
    prefix_cache: PrefixKVCache | None,
    document_cache: DocumentStore | None,
    repair: DocumentRepair,
    layers: int | None = None,
    query_window: int = 16,
    queries: DraftQueries = "look_ahead",
) -> ModelDraft | LayerPrefixDraft:
    """A separate draft model: whole with its look-ahead (``layers`` None, ``queries="look_ahead"``: the last prompt
    token and ``look_ahead - 1`` decoded tokens), or whole or its first ``layers`` layers scoring with its last
    ``query_window`` prompt tokens (see the module). Raises :class:`InvalidRequestError` for more layers than the
    model has.
    """
    if layers is None and queries == "look_ahead":
        return ModelDraft(model, look_ahead, pool_kernel, eos_token_ids, prefix_cache, document_cache, repair)
    available = len(decoder_layers(model))
    if layers is None:
        layers = available
    if not 1 <= layers <= available:
        raise InvalidRequestError(
            f"draft_layers={layers} asks for more layers than the draft model has ({available}); pass at most "
            f"{available}, or leave draft_layers unset to run them all"
        )
    return LayerPrefixDraft(model, layers, pool_kernel, query_window, prefix_cache, document_cache, repair)


@torch.inference_mode()
def _warm(
    model: Any,
    layers: int,
    store: DocumentStore | None,
    input_ids: torch.Tensor,
    documents: DocumentSpans,
    namespace: str | None,
) -> int:
    if store is None:
        return 0
    (spans, prefix_length), draft = documents.checked(input_ids.numel()), DraftIdentity.of(model, layers)
    encode_documents(model, draft, input_ids, prefix_length, spans, store, namespace, evict=False)  # never displace
    return held_documents(draft, input_ids, prefix_length, spans, store, namespace)


class _CachedDraft(Protocol):
    model: Any
    prefix_cache: PrefixKVCache | None
    document_cache: DocumentStore | None

    def score_prompt(
        self, input_ids: torch.Tensor, documents: DocumentSpans | None = None, namespace: str | None = None
    ) -> DraftScore: ...


def _score_batched(
    draft: _CachedDraft,
    prompts: list[torch.Tensor],
    documents: list[DocumentSpans | None] | None,
    namespaces: list[str | None] | None,
    limit: tuple[int, int],
    together: Callable[[list[torch.Tensor]], list[DraftScore | DraftScoringError]],
) -> list[DraftScore | DraftScoringError]:
    """Per prompt its score or its error: ``together`` scores the prompts in one batched forward, except those
    that are cheaper alone (the prefix cache serves them, their KV comes from the per-document cache, or they are
    the only one). ``limit``: the draft's layers and the queries at the prompt's end the prefix cache cannot hold.
    """
    spans = documents if documents is not None else [None] * len(prompts)
    owners = namespaces if namespaces is not None else [None] * len(prompts)
    alone = [
        len(prompts) == 1 or _has_cached_prefix(draft, p, n, limit) or _uses_documents(draft, s)
        for p, s, n in zip(prompts, spans, owners)
    ]
    batched = [(p, n) for p, n, single in zip(prompts, owners, alone) if not single]
    rows = iter(
        together([p for p, _ in batched])
        if len(batched) > 1
        else [_score_or_error(draft.score_prompt, p, None, n) for p, n in batched]
    )
    return [
        _score_or_error(draft.score_prompt, p, s, n) if single else next(rows)
        for p, s, n, single in zip(prompts, spans, owners, alone)
    ]


def _uses_documents(draft: _CachedDraft, documents: DocumentSpans | None) -> bool:
    return documents is not None and draft.document_cache is not None and documents.spans.numel() > 0


def _has_cached_prefix(
    draft: _CachedDraft, input_ids: torch.Tensor, namespace: str | None, limit: tuple[int, int]
) -> bool:
    if draft.prefix_cache is None:
        return False
    layers, queries = limit
    identity = DraftIdentity.of(draft.model, layers)
    reusable = max(input_ids.numel() - queries, 0)  # the queries are always computed
    return draft.prefix_cache.lookup(identity, input_ids, reusable, namespace) is not None


def _score_or_error(
    score: Any, input_ids: torch.Tensor, documents: DocumentSpans | None = None, namespace: str | None = None
) -> DraftScore | DraftScoringError:
    try:
        if documents is None and namespace is None:
            return score(input_ids)
        return score(input_ids, documents, namespace)
    except DraftScoringError as error:
        return error
