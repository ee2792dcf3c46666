"""SpecPrefillEngine: layout -> draft scoring -> selection -> sparse prefill and decoding.

Example::

    engine = SpecPrefillEngine(keep_rate=0.2)            # embedded SmolLM2-135M as draft and main
    result = engine.generate("When did the bridge open?", documents=[text_a, text_b])
    print(result.text, result.stats.keep_rate, result.stats.ttft_ms)
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from contextlib import aclosing
from dataclasses import dataclass
from typing import Any, Literal

import torch
from pydantic import ValidationError

from .arguments import (
    check_documents,
    check_flag,
    check_keep_rate,
    check_optional_flag,
    check_optional_text,
    check_params,
    generation_params,
)
from .backends.base import MainBackend, SparsePrompt
from .backends.hf import MAIN_MIN_REUSE_SHARE, HFBackend, eos_token_ids
from .config import AUTO, DEFAULT_SELF_LAYER_SHARE, GenerationParams, SpecPrefillConfig
from .decode.stream import Decoding, alast_result, last_result
from .decode.tool_choice import tool_decoding
from .draft.cost import REMOTE_MAIN_MIN_PROMPT_TOKENS, parameter_count, pays_from
from .draft.document_cache import DocumentKVCache, DocumentStore, shared_document_cache
from .draft.hooks import decoder_layers
from .draft.model import LayerPrefixDraft, ModelDraft
from .draft.paths import DirectScoring, DraftInput, MappedScoring, draft_scoring, warm_layout
from .draft.repair import DocumentRepair
from .errors import ContextLengthError, InvalidRequestError
from .kvcache.prefix_cache import PrefixKVCache, shared_prefix_cache
from .models.loading import LoadedModel, load_tokenizer, model_lock, shared_model
from .pipeline import Budget, DraftCost, Pipeline
from .prompt.chat import ChatLayout, ChatMessage, chat_layout
from .prompt.documents import as_document
from .prompt.layout import DocumentLike, PromptLayout, check_layout
from .prompt.render import build_rag_layout, build_text_layout
from .prompt.tools import ToolChoice
from .results import DraftPath, GenerationResult, Selection, StreamChunk
from .selection import KeepBudget

# A request's keep rate: a fraction in (0, 1], "auto", or None for the engine's setting.
RequestKeepRate = float | Literal["auto"] | None


log = logging.getLogger("specprefill_rag")
_engines: dict[tuple[SpecPrefillConfig, str], SpecPrefillEngine] = {}
_engines_lock = threading.Lock()


def _milliseconds(since: float) -> float:
    return (time.perf_counter() - since) * 1000.0


@dataclass(frozen=True)
class ChatRequest:
    """A chat ready to answer (:meth:`SpecPrefillEngine.chat_request`): what the chat methods generate from.

    Attributes:
        chat: the layout, where its documents came from (``chat.document_source``, ``chat.n_documents``) and the
            checked tools offered.
        params: the decoding, with what the tools and ``tool_choice`` add (the family's tool-call markup to parse,
            a forced call's constraint).
    """

    chat: ChatLayout
    params: GenerationParams


class SpecPrefillEngine:
    """SpecPrefill in front of a main model.

    Args:
        config: a :class:`SpecPrefillConfig`; or pass its fields as keyword arguments.

    Loads both models at construction (see :meth:`from_models` for models already in memory).
    Thread-safe: requests may run concurrently; forward passes on the shared models are serialised.
    """

    def __init__(self, config: SpecPrefillConfig | None = None, **settings: Any) -> None:
        config = _with_default_draft(_make_config(config, settings))
        if config.tokenizer is not None:
            raise InvalidRequestError(
                "tokenizer= names the tokenizer of a main model on vLLM; in-process the main model's own is used"
            )
        main = shared_model(config.main, config.device, config.dtype)
        draft = None
        if config.draft is not None and not config.is_self_draft and config.draft != config.main:
            draft = shared_model(config.draft, config.device, config.dtype)
        self._setup(config, main, draft)

    @classmethod
    def shared(
        cls, config: SpecPrefillConfig, backend: str = "transformers", timeout: float = 60.0
    ) -> SpecPrefillEngine:
        """One engine per distinct (config, backend) in this process; models are shared across configs
        too. ``backend``: ``"transformers"`` (main model in-process) or a vLLM server URL.
        """
        key = (config, backend)
        with _engines_lock:
            if key not in _engines:
                in_process = backend == "transformers"
                _engines[key] = cls(config) if in_process else cls.for_vllm(backend, config, timeout=timeout)
            return _engines[key]

    @classmethod
    def from_models(
        cls,
        main_model: Any,
        tokenizer: Any,
        draft_model: Any | None = None,
        config: SpecPrefillConfig | None = None,
        draft_tokenizer: Any | None = None,
        **settings: Any,
    ) -> SpecPrefillEngine:
        """An engine over models already loaded; ``draft_model=None`` means the main model drafts for
        itself (whole, or its first n layers with ``draft='self'`` or ``'self:<n>'``). ``draft_tokenizer``: the
        draft's own, when it differs from the main model's (the mapped path); default ``tokenizer``.
        """
        engine = cls.__new__(cls)
        config = _make_config(config, settings)
        draft = LoadedModel(draft_model, draft_tokenizer or tokenizer, "draft") if draft_model is not None else None
        engine._setup(config, LoadedModel(main_model, tokenizer, "main"), draft)
        return engine

    def _setup(self, config: SpecPrefillConfig, main: LoadedModel, draft: LoadedModel | None) -> None:
        eos = eos_token_ids(main.model, main.tokenizer)
        if config.is_self_draft:
            available = len(decoder_layers(main.model))
            n_layers = config.self_draft_layers or max(1, round(DEFAULT_SELF_LAYER_SHARE * available))
            if n_layers > available:
                raise InvalidRequestError(
                    f"draft 'self:{n_layers}' asks for more layers than the main model has ({available})"
                )
            window, cache = config.self_draft_window, _prefix_cache(config, main.model)
            documents = _document_cache(config, main.model)
            scorer: Any = LayerPrefixDraft(
                main.model,
                n_layers,
                config.pool_kernel,
                window,
                cache,
                documents,
                DocumentRepair.of(config),
            )
            scoring: DirectScoring | MappedScoring = DirectScoring(
                scorer, main.context_length, 1, config.max_draft_tokens, path="self"
            )
            share = n_layers / available
        else:
            drafting = draft if draft is not None else main
            draft_eos = eos_token_ids(drafting.model, drafting.tokenizer)
            cache = _prefix_cache(config, drafting.model)
            scorer = ModelDraft(
                drafting.model,
                config.look_ahead,
                config.pool_kernel,
                draft_eos,
                cache,
                _document_cache(config, drafting.model),
                DocumentRepair.of(config),
            )
            scoring = draft_scoring(
                scorer, drafting.tokenizer, main.tokenizer, config.look_ahead, config.max_draft_tokens
            )
            share = parameter_count(drafting.model) / parameter_count(main.model)
        floor = _prompt_floor(config, share, config.effective_look_ahead, main.context_length)
        device = next(main.model.parameters()).device
        main_cache = shared_prefix_cache(device, config.main_cache_mb * 2**20, MAIN_MIN_REUSE_SHARE)
        backend = HFBackend(main.model, eos, model_lock(main.model), main.tokenizer, main_cache, config)
        self._assemble(config, main.tokenizer, backend, scoring, main, floor)

    def _assemble(
        self,
        config: SpecPrefillConfig,
        tokenizer: Any,
        backend: MainBackend,
        scoring: DirectScoring | MappedScoring,
        main: LoadedModel | None,
        min_prompt_tokens: int,
    ) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.backend = backend
        self.draft_scoring = scoring
        self.draft = scoring.draft  # scores token ids of its own vocabulary
        self.main = main  # None when the main model runs elsewhere (vLLM)
        self.min_prompt_tokens = min_prompt_tokens  # config.min_prompt_tokens, "auto" resolved for this pair
        self.pipeline = Pipeline(config, backend.supports_sparse_prefill, min_prompt_tokens)

    @property
    def document_cache(self) -> DocumentStore | None:
        """The draft's per-document KV store (None when ``document_cache_mb`` is 0)."""
        return getattr(self.draft, "document_cache", None)

    @property
    def draft_path(self) -> DraftPath:
        """How the draft scores: ``direct`` (main's vocabulary), ``mapped`` (its own) or ``self``."""
        return self.draft_scoring.path

    @classmethod
    def for_vllm(
        cls,
        server: str | Any,
        config: SpecPrefillConfig | None = None,
        on_missing_plugin: str = "error",
        timeout: float = 60.0,
        **settings: Any,
    ) -> SpecPrefillEngine:
        """An engine whose main model runs on vLLM: ``server`` is the URL of an OpenAI-compatible vLLM
        server, or an in-process ``vllm.LLM``; both need this package installed next to vLLM (plugin),
        except with ``positions="contiguous"``, whose kept tokens go as an ordinary prompt.
        The draft (``config.draft``) runs here. The main model's tokenizer is ``config.tokenizer`` (the
        served model's name or folder), by default the draft's; the server's ``/tokenize`` checks it.
        A draft of another vocabulary than that tokenizer scores through the mapped path.
        """
        from .backends.vllm import connect

        config = _make_config(config, settings)
        if config.draft is None:
            raise InvalidRequestError(
                "a main model on vLLM needs a draft named: pass draft='<HF id, folder or .gguf>' of a small model "
                "with the served model's tokenizer (its smaller sibling; another vocabulary also works, mapped)"
            )
        if config.is_self_draft:
            raise InvalidRequestError("a 'self:<n>' draft needs the main model in-process; pick a separate draft model")
        if config.positions == "contiguous" and on_missing_plugin == "error":
            on_missing_plugin = "full_prompt"  # its prompts are ordinary ones: without the plugin it still compresses
        backend = connect(server, timeout, on_missing_plugin)  # type: ignore[arg-type]
        draft = shared_model(config.draft, config.device, config.dtype)
        draft_eos = eos_token_ids(draft.model, draft.tokenizer)
        tokenizer = load_tokenizer(config.tokenizer) if config.tokenizer is not None else draft.tokenizer
        main_eos = draft_eos if tokenizer is draft.tokenizer else eos_token_ids(None, tokenizer)
        backend.adopt_tokenizer(tokenizer, main_eos)
        backend.grammar_limits = config  # a SpecPrefillConfig is GrammarLimits
        engine = cls.__new__(cls)
        cache = _prefix_cache(config, draft.model)
        documents = _document_cache(config, draft.model)
        repair = DocumentRepair.of(config)
        scorer = ModelDraft(draft.model, config.look_ahead, config.pool_kernel, draft_eos, cache, documents, repair)
        scoring = draft_scoring(scorer, draft.tokenizer, tokenizer, config.look_ahead, config.max_draft_tokens)
        floor = REMOTE_MAIN_MIN_PROMPT_TOKENS if config.min_prompt_tokens == AUTO else config.min_prompt_tokens
        engine._assemble(config, tokenizer, backend, scoring, None, floor)
        return engine

    # -- prompts ---------------------------------------------------------------------------------

    def layout(
        self,
        question: str,
        documents: Sequence[DocumentLike],
        instructions: str | None = None,
        use_chat_template: bool = True,
    ) -> PromptLayout:
        """Token ids and roles of a RAG prompt rendered with the main model's chat template."""
        check_flag(use_chat_template, "use_chat_template")
        return build_rag_layout(self.tokenizer, question, documents, instructions, use_chat_template)

    def chat_layout(
        self,
        messages: Sequence[ChatMessage],
        documents: Sequence[DocumentLike] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        question: str | None = None,
        use_chat_template: bool = True,
        *,
        insert_missing: bool = True,
    ) -> ChatLayout:
        """A chat's layout (:func:`~specprefill_rag.prompt.chat.chat_layout`): documents found in the messages or
        given, tool results as documents, ``tools`` offered through the chat template. ``insert_missing=False``:
        ``documents`` came from the messages (a retriever's, a template variable's), so they are located, never
        inserted; when they are not all found verbatim, the fallback applies.
        """
        check_flag(use_chat_template, "use_chat_template")
        check_flag(insert_missing, "insert_missing")
        tail = self.config.protect_tail_tokens
        return chat_layout(
            self.tokenizer,
            messages,
            documents,
            tail,
            use_chat_template,
            question,
            insert_missing=insert_missing,
            tools=tools,
        )

    def text_layout(self, prompt: str, parse_special_tokens: bool = False) -> PromptLayout:
        """Layout of an already-rendered prompt (no roles: see :func:`build_text_layout`)."""
        check_flag(parse_special_tokens, "parse_special_tokens")
        return build_text_layout(self.tokenizer, prompt, self.config.protect_tail_tokens, parse_special_tokens)

    # -- selection -------------------------------------------------------------------------------

    def compresses(
        self, layout: PromptLayout, keep_rate: float | Literal["auto"], max_document_tokens: int | None
    ) -> bool:
        """Whether this request is worth a draft (:meth:`Pipeline.budget`)."""
        return self.pipeline.budget(layout, keep_rate, max_document_tokens).compressed

    def keep_budget(self, keep_rate: float | Literal["auto"]) -> KeepBudget:
        """The selection's budget policy for a checked keep rate (:meth:`Pipeline.keep_budget`)."""
        return self.pipeline.keep_budget(keep_rate)

    def select(
        self,
        layout: PromptLayout,
        keep_rate: RequestKeepRate = None,
        prepared: DraftInput | None = None,
        reselect: bool | None = None,
        draft_document_cache: bool | None = None,
        tenant: str | None = None,
    ) -> Selection:
        """Sorted kept token indices ``[K]``, the draft time in ms (0 when nothing is compressed), the
        prompt tokens the draft took from its prefix cache and the keep policy asked for. ``prepared``:
        ``draft_scoring.prepare(layout)`` when the caller already ran it, so the prompt is rendered once.
        Spans compressed by an earlier request keep their tokens unless ``reselect`` (default
        ``config.reselect``); when every span did, no draft runs. ``draft_document_cache``: take the
        documents' draft KV from the per-document cache (default ``config.draft_document_cache``).
        ``tenant``: the namespace of the caches it reads and fills (the draft's, the selection memo; None: shared).
        """
        budget = self._budget(layout, keep_rate)
        if not budget.compressed:
            return self.pipeline.whole(layout, budget)
        recalled = self.pipeline.recall(layout, budget, check_optional_flag(reselect, "reselect"), tenant)
        if recalled is not None and recalled.complete:
            return self.pipeline.select(layout, budget, None, recalled=recalled)
        started = time.perf_counter()
        documents = self.uses_document_cache(draft_document_cache)
        scored = self.draft_scoring.score(layout, prepared, documents, tenant)
        cost = DraftCost(
            _milliseconds(started),
            scored.cached_tokens,
            document_cached_tokens=scored.document_cached_tokens,
            documents_cached=scored.documents_cached,
        )
        return self.pipeline.select(layout, budget, scored.importance, cost, recalled)

    def _budget(self, layout: PromptLayout, keep_rate: RequestKeepRate) -> Budget:
        checked = check_keep_rate(keep_rate)
        rate = self.config.keep_rate if checked is None else checked
        return self.pipeline.budget(layout, rate, self.config.max_document_tokens)

    def _needs_draft(self, layout: PromptLayout, keep_rate: RequestKeepRate, reselect: bool | None) -> bool:
        """Whether :meth:`select` will run the draft: compressed, and some span is not recalled."""
        budget = self._budget(layout, keep_rate)
        recalled = self.pipeline.recall(layout, budget, reselect)
        return budget.compressed and (recalled is None or not recalled.complete)

    def uses_document_cache(self, draft_document_cache: bool | None = None) -> bool:
        """Whether a request's draft takes its documents' KV from the per-document cache: the request's
        ``draft_document_cache`` (a bool, or None for ``config.draft_document_cache``). Asking for it from an
        engine without that cache (``document_cache_mb=0``) raises :class:`InvalidRequestError`.
        """
        asked = check_optional_flag(draft_document_cache, "draft_document_cache")
        if asked is None:
            return self.config.draft_document_cache
        if asked and self.document_cache is None:
            raise InvalidRequestError(
                "draft_document_cache=True, but this engine's draft has no per-document cache (document_cache_mb=0); "
                "build the engine with document_cache_mb above 0, or leave draft_document_cache off"
            )
        return asked

    def sparse_prompt(self, layout: PromptLayout, kept: torch.Tensor, tenant: str | None = None) -> SparsePrompt:
        """What the main model prefills (:meth:`Pipeline.sparse_prompt`), in ``tenant``'s cache namespace."""
        return self.pipeline.sparse_prompt(layout, kept, tenant)

    @property
    def max_draft_tokens(self) -> int | None:
        """Most prompt tokens (the draft's own) one request may send through the draft:
        ``config.max_draft_tokens``, at most the draft's context less its look-ahead (None: no limit).
        """
        return self.draft_scoring.token_limit

    # -- generation ------------------------------------------------------------------------------

    def stream_layout(
        self,
        layout: PromptLayout,
        params: GenerationParams | None = None,
        keep_rate: RequestKeepRate = None,
        reselect: bool | None = None,
        draft_document_cache: bool | None = None,
    ) -> Iterator[StreamChunk]:
        """Stream the answer to a prepared layout; the last chunk carries the stats and full result.
        ``reselect``: score spans compressed by an earlier request again (default ``config.reselect``).
        ``draft_document_cache``: the documents' draft KV from the per-document cache (default: the config's).
        """
        params = check_params(params) or GenerationParams()
        return self._stream(layout, params, keep_rate, time.perf_counter(), reselect, draft_document_cache)

    def generate_layout(
        self,
        layout: PromptLayout,
        params: GenerationParams | None = None,
        keep_rate: RequestKeepRate = None,
        reselect: bool | None = None,
        draft_document_cache: bool | None = None,
    ) -> GenerationResult:
        return last_result(self.stream_layout(layout, params, keep_rate, reselect, draft_document_cache))

    def stream(
        self,
        question: str,
        documents: Sequence[DocumentLike],
        instructions: str | None = None,
        keep_rate: RequestKeepRate = None,
        draft_document_cache: bool | None = None,
        **params: Any,
    ) -> Iterator[StreamChunk]:
        """Stream the answer to ``question`` over ``documents``; ``params`` are :class:`GenerationParams` fields.
        ``draft_document_cache``: the documents' draft KV from the per-document cache (default: the config's).
        """
        started = time.perf_counter()
        generation = generation_params(params)
        layout = self.layout(question, documents, instructions)
        return self._stream(layout, generation, keep_rate, started, document_cache=draft_document_cache)

    def generate(
        self,
        question: str,
        documents: Sequence[DocumentLike],
        instructions: str | None = None,
        keep_rate: RequestKeepRate = None,
        draft_document_cache: bool | None = None,
        **params: Any,
    ) -> GenerationResult:
        """Answer ``question`` over ``documents``; only document tokens are compressed."""
        return last_result(self.stream(question, documents, instructions, keep_rate, draft_document_cache, **params))

    def chat_request(
        self,
        messages: Sequence[ChatMessage],
        documents: Sequence[DocumentLike] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice | None = None,
        parallel_tool_calls: bool = True,
        *,
        params: GenerationParams | None = None,
        question: str | None = None,
        insert_missing: bool = True,
    ) -> ChatRequest:
        """Lay out a chat and set its decoding (:class:`ChatRequest`), the first step of :meth:`stream_chat`;
        :meth:`stream_layout` then answers it. For a caller that reports where the documents came from (the
        framework adapters). ``params``: the decoding the tools' fields are added to; ``question`` and
        ``insert_missing``: as in :meth:`chat_layout`. Refuses bad messages, documents or tools before any model runs.
        """
        base = check_params(params) or GenerationParams()
        check_flag(parallel_tool_calls, "parallel_tool_calls")
        chat = self.chat_layout(messages, documents, tools, question, insert_missing=insert_missing)
        lazy = self.config.lazy_tool_grammar
        decoding = tool_decoding(self.tokenizer, chat.tools, tool_choice, parallel_tool_calls, lazy)
        return ChatRequest(chat, generation_params({**dict(base), **decoding}) if decoding else base)

    def stream_chat(
        self,
        messages: Sequence[ChatMessage],
        documents: Sequence[DocumentLike] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice | None = None,
        parallel_tool_calls: bool = True,
        keep_rate: RequestKeepRate = None,
        reselect: bool | None = None,
        draft_document_cache: bool | None = None,
        *,
        question: str | None = None,
        insert_missing: bool = True,
        **params: Any,
    ) -> Iterator[StreamChunk]:
        """Stream the answer to a chat; chunks carry the model's tool calls as they complete (``tool_choice``:
        ``auto``, ``none``, ``required`` or a tool's name, :mod:`specprefill_rag.decode.tool_choice`). Documents
        and tool results compressed in an earlier turn keep their tokens unless ``reselect`` (docs: Conversations).
        ``draft_document_cache``: the documents' draft KV from the per-document cache (default: the config's).
        ``question`` and ``insert_missing``: as in :meth:`chat_layout`.
        """
        started = time.perf_counter()
        request = self.chat_request(
            messages,
            documents,
            tools,
            tool_choice,
            parallel_tool_calls,
            params=generation_params(params),
            question=question,
            insert_missing=insert_missing,
        )
        return self._stream(request.chat.layout, request.params, keep_rate, started, reselect, draft_document_cache)

    def chat(
        self,
        messages: Sequence[ChatMessage],
        documents: Sequence[DocumentLike] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice | None = None,
        parallel_tool_calls: bool = True,
        keep_rate: RequestKeepRate = None,
        reselect: bool | None = None,
        draft_document_cache: bool | None = None,
        *,
        question: str | None = None,
        insert_missing: bool = True,
        **params: Any,
    ) -> GenerationResult:
        """Answer a chat (:meth:`stream_chat`); ``result.tool_calls`` holds the calls the model made."""
        chunks = self.stream_chat(
            messages,
            documents,
            tools,
            tool_choice,
            parallel_tool_calls,
            keep_rate,
            reselect,
            draft_document_cache,
            question=question,
            insert_missing=insert_missing,
            **params,
        )
        return last_result(chunks)

    def generate_text(
        self,
        prompt: str,
        keep_rate: RequestKeepRate = None,
        parse_special_tokens: bool = False,
        draft_document_cache: bool | None = None,
        **params: Any,
    ) -> GenerationResult:
        """Complete an already-rendered prompt; all but template tokens and the tail are candidates.

        Special-token strings in ``prompt`` are text unless ``parse_special_tokens=True``: pass that only
        for a prompt you rendered yourself from trusted parts (retrieved text could open a turn).
        """
        started = time.perf_counter()
        generation = generation_params(params)
        layout = self.text_layout(prompt, parse_special_tokens)
        return last_result(self._stream(layout, generation, keep_rate, started, document_cache=draft_document_cache))

    def ran(self, selection: Selection) -> DraftPath | None:
        """The draft path for the stats: None when :meth:`select` ran no draft (it then reports 0 ms)."""
        return self.draft_path if selection.draft_ms > 0 else None

    def check_length(self, prompt_tokens: int, max_new_tokens: int) -> None:
        """Raise :class:`ContextLengthError` unless the prompt and the tokens to generate fit the main model."""
        context = self.backend.context_length
        if prompt_tokens + max_new_tokens > context:
            raise ContextLengthError(prompt_tokens, max_new_tokens, context)

    def check_output(self, params: GenerationParams) -> None:
        """Refuse an output format the backend cannot enforce (compiled now and cached), before any model runs."""
        if params.output_format is not None:
            self.backend.check_output_format(params.output_format)

    def _check_request(
        self,
        layout: PromptLayout,
        params: GenerationParams,
        keep_rate: RequestKeepRate,
        reselect: bool | None,
        document_cache: bool | None = None,
    ) -> DraftInput | None:
        """Refuse a request before any model runs: bad layout or keep rate, too long for the main model's
        context, or for the draft (its context, ``max_draft_tokens``). Returns what the draft will read
        (None when no draft runs), for :meth:`select`.
        """
        check_layout(layout, len(self.tokenizer))
        check_keep_rate(keep_rate)
        check_optional_flag(reselect, "reselect")
        self.uses_document_cache(document_cache)
        self.check_length(len(layout), params.max_new_tokens)
        self.check_output(params)
        if self._needs_draft(layout, keep_rate, reselect):
            return self.draft_scoring.prepare(layout)  # raises DraftContextLengthError or DraftLimitError
        return None

    def _stream(
        self,
        layout: PromptLayout,
        params: GenerationParams,
        keep_rate: RequestKeepRate,
        started: float,
        reselect: bool | None = None,
        document_cache: bool | None = None,
    ) -> Iterator[StreamChunk]:
        prepared = self._check_request(layout, params, keep_rate, reselect, document_cache)
        return self._decode(layout, params, keep_rate, started, prepared, reselect, document_cache)

    def _decoding(self, layout: PromptLayout, params: GenerationParams, chosen: Selection, started: float) -> Decoding:
        return Decoding(self.tokenizer, layout, params, chosen, started, self.ran(chosen))

    def _decode(
        self,
        layout: PromptLayout,
        params: GenerationParams,
        keep_rate: RequestKeepRate,
        started: float,
        prepared: DraftInput | None,
        reselect: bool | None,
        document_cache: bool | None = None,
    ) -> Iterator[StreamChunk]:
        chosen = self.select(layout, keep_rate, prepared, reselect, document_cache)
        decoding = self._decoding(layout, params, chosen, started)
        generated = self.backend.generate(self.sparse_prompt(layout, chosen.kept), params, decoding.report)
        try:
            for token in generated:
                if chunk := decoding.push(token):
                    yield chunk
                if decoding.stopped:
                    break
        finally:
            generated.close()
        yield decoding.finish()

    # -- async generation (native on the event loop; see :mod:`specprefill_rag.backends.threads`) ----------

    def astream_layout(
        self,
        layout: PromptLayout,
        params: GenerationParams | None = None,
        keep_rate: RequestKeepRate = None,
        reselect: bool | None = None,
        draft_document_cache: bool | None = None,
    ) -> AsyncGenerator[StreamChunk, None]:
        """:meth:`stream_layout` for an event loop: draft scoring runs in a worker thread, tokens come from
        the backend's async interface (over HTTP for a vLLM server: no thread per request). Close the
        generator (``aclose``) to stop early; that ends the main model's request.
        """
        params = check_params(params) or GenerationParams()
        return self._astream(layout, params, keep_rate, time.perf_counter(), reselect, draft_document_cache)

    async def agenerate_layout(
        self,
        layout: PromptLayout,
        params: GenerationParams | None = None,
        keep_rate: RequestKeepRate = None,
        reselect: bool | None = None,
        draft_document_cache: bool | None = None,
    ) -> GenerationResult:
        return await alast_result(self.astream_layout(layout, params, keep_rate, reselect, draft_document_cache))

    def astream(
        self,
        question: str,
        documents: Sequence[DocumentLike],
        instructions: str | None = None,
        keep_rate: RequestKeepRate = None,
        draft_document_cache: bool | None = None,
        **params: Any,
    ) -> AsyncGenerator[StreamChunk, None]:
        """:meth:`stream` for an event loop (the prompt is tokenized on the loop)."""
        started = time.perf_counter()
        generation = generation_params(params)
        layout = self.layout(question, documents, instructions)
        return self._astream(layout, generation, keep_rate, started, document_cache=draft_document_cache)

    async def agenerate(
        self,
        question: str,
        documents: Sequence[DocumentLike],
        instructions: str | None = None,
        keep_rate: RequestKeepRate = None,
        draft_document_cache: bool | None = None,
        **params: Any,
    ) -> GenerationResult:
        """:meth:`generate` for an event loop."""
        chunks = self.astream(question, documents, instructions, keep_rate, draft_document_cache, **params)
        return await alast_result(chunks)

    def astream_chat(
        self,
        messages: Sequence[ChatMessage],
        documents: Sequence[DocumentLike] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice | None = None,
        parallel_tool_calls: bool = True,
        keep_rate: RequestKeepRate = None,
        reselect: bool | None = None,
        draft_document_cache: bool | None = None,
        *,
        question: str | None = None,
        insert_missing: bool = True,
        **params: Any,
    ) -> AsyncGenerator[StreamChunk, None]:
        """:meth:`stream_chat` for an event loop (the chat is laid out on the loop)."""
        started = time.perf_counter()
        request = self.chat_request(
            messages,
            documents,
            tools,
            tool_choice,
            parallel_tool_calls,
            params=generation_params(params),
            question=question,
            insert_missing=insert_missing,
        )
        return self._astream(request.chat.layout, request.params, keep_rate, started, reselect, draft_document_cache)

    async def achat(
        self,
        messages: Sequence[ChatMessage],
        documents: Sequence[DocumentLike] | None = None,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: ToolChoice | None = None,
        parallel_tool_calls: bool = True,
        keep_rate: RequestKeepRate = None,
        reselect: bool | None = None,
        draft_document_cache: bool | None = None,
        *,
        question: str | None = None,
        insert_missing: bool = True,
        **params: Any,
    ) -> GenerationResult:
        """:meth:`chat` for an event loop."""
        chunks = self.astream_chat(
            messages,
            documents,
            tools,
            tool_choice,
            parallel_tool_calls,
            keep_rate,
            reselect,
            draft_document_cache,
            question=question,
            insert_missing=insert_missing,
            **params,
        )
        return await alast_result(chunks)

    def _astream(
        self,
        layout: PromptLayout,
        params: GenerationParams,
        keep_rate: RequestKeepRate,
        started: float,
        reselect: bool | None = None,
        document_cache: bool | None = None,
    ) -> AsyncGenerator[StreamChunk, None]:
        prepared = self._check_request(layout, params, keep_rate, reselect, document_cache)
        return self._adecode(layout, params, keep_rate, started, prepared, reselect, document_cache)

    async def _adecode(
        self,
        layout: PromptLayout,
        params: GenerationParams,
        keep_rate: RequestKeepRate,
        started: float,
        prepared: DraftInput | None,
        reselect: bool | None,
        document_cache: bool | None = None,
    ) -> AsyncGenerator[StreamChunk, None]:
        chosen = await asyncio.to_thread(self.select, layout, keep_rate, prepared, reselect, document_cache)
        async with aclosing(self._astream_kept(layout, params, chosen, started)) as chunks:
            async for chunk in chunks:
                yield chunk

    def astream_selected(
        self,
        layout: PromptLayout,
        params: GenerationParams,
        chosen: Selection,
        started: float,
        tenant: str | None = None,
    ) -> AsyncGenerator[StreamChunk, None]:
        """:meth:`astream_layout` with the kept indices chosen elsewhere: the gateway scores the drafts of
        concurrent requests in batches. ``started``: ``time.perf_counter()`` at arrival; ``tenant``: the
        namespace of the main model's prefix cache (None: shared).
        """
        self.check_length(len(layout), params.max_new_tokens)
        self.check_output(params)
        return self._astream_kept(layout, params, chosen, started, tenant)

    async def _astream_kept(
        self,
        layout: PromptLayout,
        params: GenerationParams,
        chosen: Selection,
        started: float,
        tenant: str | None = None,
    ) -> AsyncGenerator[StreamChunk, None]:
        decoding = self._decoding(layout, params, chosen, started)
        prompt = self.sparse_prompt(layout, chosen.kept, tenant)
        async with aclosing(self.backend.agenerate(prompt, params, decoding.report)) as generated:
            async for token in generated:
                if chunk := decoding.push(token):
                    yield chunk
                if decoding.stopped:
                    break
        yield decoding.finish()

    # -- per-document draft cache ----------------------------------------------------------------

    def warm_documents(
        self,
        documents: Sequence[DocumentLike],
        instructions: str | None = None,
        *,
        stop: threading.Event | None = None,
        tenant: str | None = None,
    ) -> int:
        """Draft each document once into the per-document draft cache, after the prefix :meth:`layout` renders
        for ``instructions``, so later requests with ``draft_document_cache`` take their KV from it. Entries are
        keyed by that prefix: only requests with the same instructions (system message) find them, and by
        ``tenant``: only that tenant's requests find them (None: the shared namespace).

        Every document is checked before any is drafted. Stops before the cache would have to drop entries, and
        before the next document once ``stop`` is set (a caller's deadline); returns the documents drafted and
        held (0 when ``document_cache_mb`` is 0).
        """
        checked = [as_document(document, i) for i, document in enumerate(check_documents(documents))]
        check_optional_text(instructions, "instructions", "system instructions")
        store = self.document_cache
        if store is None:
            return 0
        warmed, bytes_per_token = 0, 0.0
        for document in checked:
            if stop is not None and stop.is_set():
                break
            layout = self.layout(_WARM_QUESTION, [document], instructions)
            tokens, free = max(layout.n_document_tokens, 1), store.free_bytes()
            if bytes_per_token * tokens > free:
                break
            held = warm_layout(self.draft_scoring, layout, tenant)
            bytes_per_token = max(bytes_per_token, (free - store.free_bytes()) / tokens)
            warmed += held
        return warmed


_WARM_QUESTION = "?"  # the question comes after the documents: it never changes what is warmed


def _prefix_cache(config: SpecPrefillConfig, draft_model: Any) -> PrefixKVCache | None:
    """The shared draft prefix cache for ``draft_model``'s device, or ``None`` when ``config`` turns it off."""
    return shared_prefix_cache(next(draft_model.parameters()).device, config.draft_cache_mb * 2**20)


def _document_cache(config: SpecPrefillConfig, draft_model: Any) -> DocumentKVCache | None:
    """The shared per-document draft cache for ``draft_model``'s device, or ``None`` when ``config`` turns it off."""
    return shared_document_cache(next(draft_model.parameters()).device, config.document_cache_mb * 2**20)


def _with_default_draft(config: SpecPrefillConfig) -> SpecPrefillConfig:
    """``config`` with 'self' as its draft when none is named; a set ``look_ahead`` then asks for a draft."""
    try:
        return config.with_default_draft()
    except ValidationError as error:  # look_ahead was set, and no draft model named
        raise InvalidRequestError(str(error.errors()[0]["msg"]).removeprefix("Value error, ")) from None


def _prompt_floor(config: SpecPrefillConfig, draft_share: float, look_ahead: int, context_length: int) -> int:
    """``config.min_prompt_tokens``, or for "auto" the length from which this draft pays
    (:func:`~specprefill_rag.draft.cost.pays_from`); past the context (nothing compressed) when it never does.
    """
    if config.min_prompt_tokens != AUTO:
        return config.min_prompt_tokens
    floor = pays_from(draft_share, look_ahead)
    if floor is None:
        log.warning(
            "the draft costs %.0f%% of the main model per prompt token, so it cannot save time and no prompt is "
            "compressed; use draft='self' or a smaller draft, or set min_prompt_tokens to compress anyway",
            100 * draft_share,
        )
        return context_length + 1
    return floor


def _make_config(config: SpecPrefillConfig | None, settings: dict[str, Any]) -> SpecPrefillConfig:
    if config is not None and settings:
        raise InvalidRequestError("pass either a SpecPrefillConfig or its fields as keyword arguments, not both")
    return config if config is not None else SpecPrefillConfig(**settings)
