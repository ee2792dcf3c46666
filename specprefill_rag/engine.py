"""SpecPrefillEngine: the public entry points over one request path (:mod:`specprefill_rag.pipeline`).

Example::

    engine = SpecPrefillEngine(keep_rate=0.2)            # embedded SmolLM2-135M as draft and main
    result = engine.generate("When did the bridge open?", documents=[text_a, text_b])
    print(result.text, result.stats.keep_rate, result.stats.ttft_ms)

Every entry point lays out its prompt, checks its options once (:class:`~specprefill_rag.request.RequestOptions`)
and hands both to one core: :meth:`SpecPrefillEngine._plan` (refuse before any model runs), the pipeline's
``choose`` (draft and selection), the backend's decoding. The models are assembled by :mod:`specprefill_rag.factory`.
"""

from __future__ import annotations

import threading
import time
from collections.abc import AsyncGenerator, Generator, Mapping, Sequence
from contextlib import aclosing, closing
from dataclasses import dataclass
from functools import partial
from typing import Any, Literal

import torch

from .arguments import (
    check_documents,
    check_flag,
    check_optional_text,
    check_params,
    generation_params,
)
from .backends.base import SparsePrompt
from .config import GenerationParams, SpecPrefillConfig
from .decode.requests import RequestStream, answered, answered_on_loop, on_loop
from .decode.stream import Decoding, last_result
from .decode.tool_choice import tool_decoding
from .errors import ContextLengthError, InvalidRequestError
from .factory import DocumentStore, DraftInput, EngineParts, load, make_config, on_vllm, over_models, warm_layout
from .pipeline import DraftPlan, InlineScorer
from .prompt.chat import ChatLayout, ChatMessage, chat_layout
from .prompt.documents import as_document
from .prompt.layout import Document, DocumentLike, PromptLayout, check_layout
from .prompt.render import build_rag_layout, build_text_layout
from .prompt.tools import ToolChoice
from .request import RequestOptions
from .results import DraftPath, GenerationResult, Selection, SkippedDocument, StreamChunk, WarmReport
from .selection import KeepBudget

# A request's keep rate: a fraction in (0, 1], "auto", or None for the engine's setting.
RequestKeepRate = float | Literal["auto"] | None


_engines: dict[tuple[SpecPrefillConfig, str], SpecPrefillEngine] = {}
_engines_lock = threading.Lock()


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


def _options(
    keep_rate: RequestKeepRate = None,
    reselect: bool | None = None,
    draft_document_cache: bool | None = None,
    tenant: str | None = None,
) -> RequestOptions:
    """A public method's per-request keywords as one checked :class:`RequestOptions`."""
    return RequestOptions.checked(
        keep_rate=keep_rate, reselect=reselect, draft_document_cache=draft_document_cache, tenant=tenant
    )


class SpecPrefillEngine:
    """SpecPrefill in front of a main model.

    Args:
        config: a :class:`SpecPrefillConfig`; or pass its fields as keyword arguments.
        parts: models, draft, caches and backend already assembled (:mod:`specprefill_rag.factory`); the
            constructors :meth:`from_models` and :meth:`for_vllm` pass them.

    Loads both models at construction (see :meth:`from_models` for models already in memory).
    Thread-safe: requests may run concurrently; forward passes on the shared models are serialised.
    """

    def __init__(
        self, config: SpecPrefillConfig | None = None, *, parts: EngineParts | None = None, **settings: Any
    ) -> None:
        if parts is not None and (config is not None or settings):
            raise InvalidRequestError("pass either assembled parts or a config, not both")
        parts = parts or load(make_config(config, settings))
        self.config = parts.config
        self.tokenizer = parts.tokenizer
        self.backend = parts.backend
        self.draft_scoring = parts.scoring
        self.draft = parts.scoring.draft  # scores token ids of its own vocabulary
        self.main = parts.main  # None when the main model runs elsewhere (vLLM)
        self.pipeline = parts.pipeline
        self.min_prompt_tokens = parts.pipeline.min_prompt_tokens  # config.min_prompt_tokens resolved for the pair
        self.scorer = InlineScorer(self.draft)

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
        config = make_config(config, settings)
        return cls(parts=over_models(config, main_model, tokenizer, draft_model, draft_tokenizer))

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
        return cls(parts=on_vllm(make_config(config, settings), server, on_missing_plugin, timeout))

    @property
    def document_cache(self) -> DocumentStore | None:
        """The draft's per-document KV store (None when ``document_cache_mb`` is 0)."""
        return self.draft.document_cache

    @property
    def draft_path(self) -> DraftPath:
        """How the draft scores: ``direct`` (main's vocabulary), ``mapped`` (its own) or ``self``."""
        return self.draft_scoring.path

    @property
    def max_draft_tokens(self) -> int | None:
        """Most prompt tokens (the draft's own) one request may send through the draft:
        ``config.max_draft_tokens``, at most the draft's context less its look-ahead (None: no limit).
        """
        return self.draft_scoring.token_limit

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
        tool_choice: ToolChoice | None = None,
    ) -> ChatLayout:
        """A chat's layout (:func:`~specprefill_rag.prompt.chat.chat_layout`): documents found in the messages or
        given, tool results as documents, ``tools`` offered through the chat template. ``insert_missing=False``:
        ``documents`` came from the messages (a retriever's, a template variable's), so they are located, never
        inserted; when they are not all found verbatim, the fallback applies. ``tool_choice``: the request's, to tell
        an agent's first step (``awaiting_tool_results``) from a forced call.
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
            system_context=self.config.system_context,
            tool_choice=tool_choice,
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
        options = _options(keep_rate, reselect, draft_document_cache, tenant)
        return self.pipeline.choose(self.pipeline.plan(layout, options, prepared), self.scorer)

    def uses_document_cache(self, draft_document_cache: bool | None = None) -> bool:
        """Whether a request's draft takes its documents' KV from the per-document cache: the request's
        ``draft_document_cache`` (a bool, or None for ``config.draft_document_cache``). Asking for it from an
        engine without that cache (``document_cache_mb=0``) raises :class:`InvalidRequestError`.
        """
        return bool(self.pipeline.resolve(_options(draft_document_cache=draft_document_cache)).draft_document_cache)

    def sparse_prompt(
        self, layout: PromptLayout, kept: torch.Tensor, options: RequestOptions | None = None
    ) -> SparsePrompt:
        """What the main model prefills (:meth:`Pipeline.sparse_prompt`)."""
        return self.pipeline.sparse_prompt(layout, kept, options)

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

    # -- generation: each form lays out its prompt, checks its options and runs the one core below ------

    def stream_layout(
        self,
        layout: PromptLayout,
        params: GenerationParams | None = None,
        keep_rate: RequestKeepRate = None,
        reselect: bool | None = None,
        draft_document_cache: bool | None = None,
    ) -> RequestStream:
        """Stream the answer to a prepared layout; the last chunk carries the stats and full result.
        ``reselect``: score spans compressed by an earlier request again (default ``config.reselect``).
        ``draft_document_cache``: the documents' draft KV from the per-document cache (default: the config's).
        """
        params = check_params(params) or GenerationParams()
        return self._stream(layout, params, _options(keep_rate, reselect, draft_document_cache))

    generate_layout = answered(stream_layout)
    """Answer a prepared layout (the arguments of :meth:`stream_layout`)."""
    agenerate_layout = answered_on_loop(stream_layout)
    """:meth:`generate_layout` for an event loop (awaitable)."""
    astream_layout = on_loop(stream_layout)
    """:meth:`stream_layout` for an event loop: draft scoring runs in a worker thread, tokens come from the
    backend's async interface (over HTTP for a vLLM server: no thread per request). Close the generator (``aclose``)
    to stop early; that ends the main model's request.
    """

    def stream(
        self,
        question: str,
        documents: Sequence[DocumentLike],
        instructions: str | None = None,
        keep_rate: RequestKeepRate = None,
        draft_document_cache: bool | None = None,
        **params: Any,
    ) -> RequestStream:
        """Stream the answer to ``question`` over ``documents``; ``params`` are :class:`GenerationParams` fields.
        ``draft_document_cache``: the documents' draft KV from the per-document cache (default: the config's).
        """
        started = time.perf_counter()
        generation = generation_params(params)
        layout = self.layout(question, documents, instructions)
        return self._stream(layout, generation, _options(keep_rate, None, draft_document_cache), started)

    generate = answered(stream)
    """Answer ``question`` over ``documents`` (the arguments of :meth:`stream`); only document tokens are compressed."""
    agenerate = answered_on_loop(stream)
    """:meth:`generate` for an event loop (awaitable)."""
    astream = on_loop(stream)
    """:meth:`stream` for an event loop (the prompt is tokenized on the loop)."""

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
        """Lay out a chat and set its decoding (:class:`ChatRequest`), the first step of every chat method;
        :meth:`stream_layout` then answers it. For a caller that reports where the documents came from (the
        framework adapters). ``params``: the decoding the tools' fields are added to; ``question`` and
        ``insert_missing``: as in :meth:`chat_layout`. Refuses bad messages, documents or tools before any model runs.
        """
        base = check_params(params) or GenerationParams()
        check_flag(parallel_tool_calls, "parallel_tool_calls")
        chat = self.chat_layout(
            messages, documents, tools, question, insert_missing=insert_missing, tool_choice=tool_choice
        )
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
    ) -> RequestStream:
        """Stream the answer to a chat; chunks carry the model's tool calls as they complete (``tool_choice``:
        ``auto``, ``none``, ``required`` or a tool's name, :mod:`specprefill_rag.decode.tool_choice`). Documents
        and tool results compressed in an earlier turn keep their tokens unless ``reselect`` (docs: Conversations).
        ``draft_document_cache``: the documents' draft KV from the per-document cache (default: the config's).
        ``question`` and ``insert_missing``: as in :meth:`chat_layout`.
        """
        started = time.perf_counter()
        generation = generation_params(params)
        chat = (messages, documents, tools, tool_choice, parallel_tool_calls)
        request = self.chat_request(*chat, params=generation, question=question, insert_missing=insert_missing)
        options = _options(keep_rate, reselect, draft_document_cache)
        return self._stream(request.chat.layout, request.params, options, started)

    chat = answered(stream_chat)
    """Answer a chat (the arguments of :meth:`stream_chat`); ``result.tool_calls`` holds the calls the model made."""
    achat = answered_on_loop(stream_chat)
    """:meth:`chat` for an event loop (awaitable)."""
    astream_chat = on_loop(stream_chat)
    """:meth:`stream_chat` for an event loop (the chat is laid out on the loop)."""

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
        return last_result(self._stream(layout, generation, _options(keep_rate, None, draft_document_cache), started))

    def astream_selected(
        self,
        layout: PromptLayout,
        params: GenerationParams,
        chosen: Selection,
        started: float,
        options: RequestOptions | None = None,
    ) -> AsyncGenerator[StreamChunk, None]:
        """:meth:`astream_layout` with the kept indices chosen elsewhere: the gateway scores the drafts of
        concurrent requests in batches. ``started``: ``time.perf_counter()`` at arrival; ``options``: the request's.
        """
        self.check_length(len(layout), params.max_new_tokens)
        self.check_output(params)
        decoding, prompt = self._start(layout, params, chosen, started, options or RequestOptions())
        return self._agenerate(prompt, params, decoding)

    # -- the core: every entry point above ends here ---------------------------------------------------

    def _stream(
        self, layout: PromptLayout, params: GenerationParams, options: RequestOptions, started: float | None = None
    ) -> RequestStream:
        """A request checked and planned now (:meth:`_plan`), answered when iterated or taken onto a loop."""
        started = time.perf_counter() if started is None else started
        plan = self._plan(layout, params, options)
        return RequestStream(
            partial(self._decode, plan, params, started), partial(self._adecode, plan, params, started)
        )

    def _plan(self, layout: PromptLayout, params: GenerationParams, options: RequestOptions) -> DraftPlan:
        """Refuse a request before any model runs: a bad layout, a document cache the draft lacks, too long for
        the main model's context or for the draft (its context, ``max_draft_tokens``), an output format the
        backend cannot enforce. Returns its plan (:meth:`Pipeline.plan`: what the draft will read).
        """
        check_layout(layout, len(self.tokenizer))
        options = self.pipeline.resolve(options)
        self.check_length(len(layout), params.max_new_tokens)
        self.check_output(params)
        return self.pipeline.plan(layout, options)  # raises DraftContextLengthError or DraftLimitError

    def _start(
        self,
        layout: PromptLayout,
        params: GenerationParams,
        chosen: Selection,
        started: float,
        options: RequestOptions,
    ) -> tuple[Decoding, SparsePrompt]:
        """The decoding of a request's tokens, made right before the main prefill, and what that prefills."""
        decoding = Decoding(self.tokenizer, layout, params, chosen, started, self.ran(chosen))
        return decoding, self.sparse_prompt(layout, chosen.kept, options)

    def _decode(self, plan: DraftPlan, params: GenerationParams, started: float) -> Generator[StreamChunk, None, None]:
        """Answer in this thread: the draft and the main model run here (blocking)."""
        chosen = self.pipeline.choose(plan, self.scorer)
        decoding, prompt = self._start(plan.layout, params, chosen, started, plan.options)
        with closing(self.backend.generate(prompt, params, decoding.report)) as generated:
            yield from decoding.chunks(generated)
        yield decoding.finish()

    async def _adecode(
        self, plan: DraftPlan, params: GenerationParams, started: float
    ) -> AsyncGenerator[StreamChunk, None]:
        """Answer on the event loop: the draft in a worker thread, tokens from the backend's async interface."""
        chosen = await self.pipeline.achoose(plan, self.scorer)
        decoding, prompt = self._start(plan.layout, params, chosen, started, plan.options)
        async with aclosing(self._agenerate(prompt, params, decoding)) as chunks:
            async for chunk in chunks:
                yield chunk

    async def _agenerate(
        self, prompt: SparsePrompt, params: GenerationParams, decoding: Decoding
    ) -> AsyncGenerator[StreamChunk, None]:
        """The chunks of ``prompt``'s tokens from the backend's async interface, then the last one."""
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
        for ``instructions``, so later requests with ``draft_document_cache`` take their KV from it; returns the
        documents drafted and held (0 when ``document_cache_mb`` is 0). :meth:`warm_report` says which were not,
        and why.
        """
        return self.warm_report(documents, instructions, stop=stop, tenant=tenant).warmed

    def warm_report(
        self,
        documents: Sequence[DocumentLike],
        instructions: str | None = None,
        *,
        stop: threading.Event | None = None,
        tenant: str | None = None,
    ) -> WarmReport:
        """:meth:`warm_documents`, reporting each document not held: its index and why (:class:`WarmReport`).

        Entries are keyed by the prefix: only requests with the same instructions (system message) find them, and
        by ``tenant``: only that tenant's requests find them (None: the shared namespace).
        Every document is checked before any is drafted, against the draft's context too (one that cannot be
        drafted is an :class:`InvalidRequestError` naming its index, alone or among others). Never drops an entry
        the cache holds: once a document has no room, it and the rest are skipped as ``cache_full``; once
        ``stop`` is set (a caller's deadline, a client gone), the rest are skipped as ``stopped``.
        """
        checked = [as_document(document, i) for i, document in enumerate(check_documents(documents))]
        check_optional_text(instructions, "instructions", "system instructions")
        if self.document_cache is None:
            return WarmReport(0)
        layouts = [self._warm_layout(i, document, instructions) for i, document in enumerate(checked)]
        warmed, skipped = 0, []
        for index, layout in enumerate(layouts):
            if stop is not None and stop.is_set():
                skipped.append(SkippedDocument(index, "stopped"))
            elif skipped and skipped[-1].reason == "cache_full":
                skipped.append(SkippedDocument(index, "cache_full"))
            elif held := warm_layout(self.draft_scoring, layout, tenant):
                warmed += held
            else:
                skipped.append(SkippedDocument(index, "cache_full"))
        return WarmReport(warmed, tuple(skipped))

    def _warm_layout(self, index: int, document: Document, instructions: str | None) -> PromptLayout:
        """The layout that warms ``document``, checked against the draft's context (nothing drafted yet)."""
        layout = self.layout(_WARM_QUESTION, [document], instructions)
        try:
            self.draft_scoring.prepare(layout)
        except InvalidRequestError as error:
            raise InvalidRequestError(f"document {index} cannot be warmed: {error}") from None
        return layout


_WARM_QUESTION = "?"  # the question comes after the documents: it never changes what is warmed
