"""One request through the gateway: layout -> (draft queue) -> selection -> main model, as stream chunks.

The gateway owns no model code: it takes the engine's request path (:class:`~specprefill_rag.pipeline.Pipeline`:
plan, draft, kept tokens, sparse prompt) with its own scorer, :class:`QueuedScorer` (the shared
:class:`~specprefill_rag.serve.queue.DraftQueue` scores concurrent prompts in batches), and streams through
:meth:`SpecPrefillEngine.astream_selected`. A draft failure follows ``on_draft_error``; a prompt too long for the
draft is a 400, as the engine's ``DraftLimitError``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Awaitable, Callable
from contextlib import aclosing
from dataclasses import dataclass, field
from typing import Any

import torch

from ..config import GenerationParams
from ..decode.stream import selected
from ..draft.assembly import DocumentSpans
from ..draft.importance import DraftScore
from ..draft.paths import DraftInput, draft_score_batch
from ..engine import SpecPrefillEngine
from ..errors import InvalidRequestError
from ..pipeline import DocumentCacheOff, DraftCost, Drafted, DraftPlan
from ..prompt.chat import ChatLayout
from ..prompt.layout import Document
from ..request import RequestOptions
from ..results import DraftPath, Selection, StreamChunk
from .errors import ClientGone, bad_request, deadline_exceeded, draft_failed, queue_full, workers_busy
from .guard import BodyReaders, Slots
from .metrics import GatewayMetrics
from .queue import DraftQueue, QueueFull
from .schema import SpecPrefillOptions, WarmDocumentsRequest
from .settings import GatewaySettings
from .tenancy import Tenancy
from .workers import Workers, WorkersBusy

log = logging.getLogger("specprefill_rag.serve")
DOCUMENT_CACHE_FIELD = "spec_prefill.draft_document_cache"


@dataclass(frozen=True)
class Plan:
    """A validated request: its layout, decoding parameters, SpecPrefill options, arrival time and tenant (the
    namespace of the caches it reads and fills: :mod:`~specprefill_rag.serve.tenancy`; None: shared).
    """

    layout: ChatLayout
    params: GenerationParams
    options: SpecPrefillOptions
    started: float = field(default_factory=time.perf_counter)
    tenant: str | None = None


@dataclass(frozen=True)
class Answer:
    """One stream chunk and the selection behind it (its stats and extras go in the last chunk)."""

    chunk: StreamChunk
    selection: Selection

    def spec_prefill(self, plan: Plan) -> dict[str, Any] | None:
        """The response's ``spec_prefill`` object (last chunk only)."""
        if self.chunk.stats is None:
            return None
        return {**self.chunk.stats.as_dict(), **self._extras(plan)}

    def before_first_token(self, plan: Plan, draft_path: DraftPath | None) -> dict[str, Any]:
        """The ``spec_prefill`` fields known before the first token (the response headers)."""
        return {**selected(plan.layout.layout, self.selection, draft_path), **self._extras(plan)}

    def _extras(self, plan: Plan) -> dict[str, Any]:
        return {
            "document_source": plan.layout.document_source,
            "n_documents": plan.layout.n_documents,
            "queue_ms": self.selection.queue_ms,
            "draft_batch_size": self.selection.batch_size,
            "draft_error": self.selection.draft_error,
        }


@dataclass(frozen=True)
class QueuedScorer:
    """The gateway's scorer (:class:`~specprefill_rag.pipeline.AsyncScorer`): prompts wait in the draft queue and
    are scored in batches; the cost records the wait and the batch.
    """

    queue: DraftQueue

    async def ascore(self, prepared: DraftInput, documents: DocumentSpans | None, options: RequestOptions) -> Drafted:
        queued = time.perf_counter()
        scored = await self.queue.score(prepared.token_ids, documents, options.tenant)
        queue_ms = max((time.perf_counter() - queued) * 1000.0 - scored.draft_ms, 0.0)
        cost = DraftCost(
            scored.draft_ms,
            scored.cached_tokens,
            queue_ms,
            scored.batch_size,
            scored.document_cached_tokens,
            scored.documents_cached,
        )
        return Drafted(scored.importance, cost)


class Gateway:
    """The engine, the draft queue, the bound on requests in flight and the metrics of one gateway process."""

    def __init__(self, settings: GatewaySettings, engine: SpecPrefillEngine) -> None:
        self.settings = settings
        self.engine = engine
        self.queue = DraftQueue(
            self._score_batch,
            settings.queue_size,
            settings.resolved_draft_batch_size(),
            settings.draft_batch_tokens,
            settings.batch_window_ms / 1000.0,
        )
        self.slots = Slots(settings.max_concurrent_requests, settings.max_requests_per_key)
        self.grammar_workers = Workers("grammar", settings.grammar_workers, settings.grammar_queue)
        self.warm_workers = Workers("warm", settings.warm_workers, settings.warm_queue)
        self.tenancy = Tenancy.of(settings)
        self.readers = BodyReaders(settings.max_connections, settings.max_bodies_per_client)
        self.metrics = GatewayMetrics(lambda: self.queue.depth, engine.draft.prefix_cache, engine.document_cache)
        self.queue.on_batch = self.metrics.batch
        self.scorer = QueuedScorer(self.queue)
        self.defaults = RequestOptions(
            settings.keep_rate, settings.max_document_tokens, draft_document_cache=settings.draft_document_cache
        )

    def _score_batch(
        self,
        prompts: list[torch.Tensor],
        documents: list[DocumentSpans | None] | None = None,
        namespaces: list[str | None] | None = None,
    ) -> list[DraftScore | Exception]:
        """Blocking: one batched draft forward (in the queue's worker thread), results on the CPU. ``documents``:
        per prompt its documents to take from the per-document cache, or None; ``namespaces``: per prompt its
        tenant's cache namespace.
        """
        return draft_score_batch(self.engine.draft, prompts, documents, namespaces)

    async def answer(self, plan: Plan) -> AsyncGenerator[Answer, None]:
        """Stream one request; raises :class:`GatewayError` or the engine's errors before the first chunk."""
        layout = plan.layout.layout
        self.engine.check_length(len(layout), plan.params.max_new_tokens)
        drafting = self._plan(plan)
        selection = await self._select(drafting)
        chunks = self.engine.astream_selected(layout, plan.params, selection, plan.started, drafting.options)
        async with aclosing(chunks):
            async for chunk in chunks:
                yield Answer(chunk, selection)

    async def _select(self, drafting: DraftPlan) -> Selection:
        """The engine's request path (:meth:`Pipeline.achoose`), the draft scored in the queue."""
        return await self.engine.pipeline.achoose(drafting, self.scorer, self._on_draft_error)

    def _plan(self, plan: Plan) -> DraftPlan:
        """The request's way through the engine's pipeline (:meth:`Pipeline.plan`), its options over the gateway's
        defaults; a 400 naming the field for what the client must fix (a document cache the gateway lacks; a prompt
        too long for the draft raises the engine's error, which the app answers as a 400 in the wire's words).
        """
        options = self._options(plan)
        try:
            return self.engine.pipeline.plan(plan.layout.layout, options, on_draft_error=self._on_draft_error)
        except DocumentCacheOff as error:
            raise bad_request(str(error), DOCUMENT_CACHE_FIELD) from None

    def _options(self, plan: Plan) -> RequestOptions:
        """A request's ``spec_prefill`` options over the gateway's settings (then the engine's config), in its
        tenant's cache namespace.
        """
        fields = ("keep_rate", "max_document_tokens", "reselect", "draft_document_cache", "enabled")
        given = {name: getattr(plan.options, name) for name in fields}
        return RequestOptions(**given, tenant=plan.tenant).over(self.defaults)

    def _on_draft_error(self, error: Exception) -> str:
        """``--on-draft-error`` for a draft that failed on a request: ``fail`` answers 500, ``full`` returns the
        ``draft_error`` the request then goes uncompressed with. A full queue is a 429 either way.
        """
        if isinstance(error, QueueFull):
            raise queue_full(error.depth, error.retry_after_s) from None
        on_error = self.settings.on_draft_error
        self.metrics.draft_errors.labels(type(error).__name__, on_error).inc()
        if on_error == "fail":
            raise draft_failed(error) from error
        log.warning(
            "draft failed (%s: %s); sending the request uncompressed (--on-draft-error full)",
            type(error).__name__,
            error,
        )
        return f"{type(error).__name__}: {error}"

    async def check_output(self, check: Callable[[], None], started: float) -> None:
        """Run ``check`` (the backend compiling a request's output grammar, blocking) on the grammar workers, within
        the request's deadline (``started``: its arrival). 503 when those workers are all taken; 504 when the
        deadline passes first: the compile goes on to its end (bounded by the schema limits) and is cached.
        """
        try:
            job = self.grammar_workers.submit(check)
        except WorkersBusy as busy:
            raise workers_busy("grammar", busy.threads, busy.queue, "--grammar-workers or --grammar-queue") from None
        left = self.settings.request_timeout_s - (time.perf_counter() - started)
        try:
            done, _ = await asyncio.wait({job}, timeout=max(left, 0.0))
        finally:
            job.cancel()  # past the deadline or with the client gone: drops a job not started (a running one ends)
        if not done:
            phase = (
                "compiling the output format's grammar (a simpler schema compiles sooner; once compiled it is cached)"
            )
            raise deadline_exceeded(self.settings.request_timeout_s, phase)
        job.result()

    async def warm(
        self,
        request: WarmDocumentsRequest,
        tenant: str | None = None,
        gone: Callable[[], Awaitable[None]] | None = None,
    ) -> dict[str, Any]:
        """Draft ``request.documents`` into the per-document cache in ``tenant``'s namespace (on the warm-up
        workers; each document under the draft's lock, between the queue's batches) without dropping what it holds;
        the answer lists each document not held (``skipped``: index and reason), and ``held`` and ``cache_bytes``
        count the tenant's own entries. 400 when the gateway has no such cache or a document is bad; 503 when the
        warm-up workers are all taken; 504 when ``--request-timeout`` passes first, :class:`ClientGone` when
        ``gone()`` (waits for the client's disconnect) completes first: either way the documents drafted by then
        stay held and the worker stops after the document in hand.
        """
        store = self.engine.document_cache
        if store is None:
            raise bad_request(
                "this gateway runs without the per-document draft cache (--document-cache-mb 0), so there is "
                "nothing to warm; start it with --document-cache-mb above 0 and --draft-document-cache (or send "
                f"{DOCUMENT_CACHE_FIELD} true with each request)",
                "documents",
            )
        documents = [d if isinstance(d, str) else Document(d.text, d.title, d.id) for d in request.documents]
        stop = threading.Event()
        try:  # the warm-up workers: never the threads of other requests
            work = self.warm_workers.submit(
                self.engine.warm_report, documents, request.instructions, stop=stop, tenant=tenant
            )
        except WorkersBusy as busy:
            raise workers_busy("warm-up", busy.threads, busy.queue, "--warm-workers or --warm-queue") from None
        watch = asyncio.ensure_future(gone()) if gone is not None else None
        try:
            waited: set[asyncio.Future[Any]] = {work} if watch is None else {work, watch}
            await asyncio.wait(waited, timeout=self.settings.request_timeout_s, return_when=asyncio.FIRST_COMPLETED)
            if not work.done():
                stop.set()
                report = await work
                if watch is not None and watch.done():
                    raise ClientGone
                drafted = f"{report.warmed} of {len(documents)} drafted and held; send the rest again"
                raise deadline_exceeded(self.settings.request_timeout_s, f"warming documents ({drafted})")
            report = work.result()
        except InvalidRequestError as error:
            raise bad_request(str(error), "documents") from None
        finally:
            stop.set()  # a cancelled request (client gone) stops the worker too
            if watch is not None:
                watch.cancel()
        mine = store.held(tenant)
        skipped = [{"index": s.index, "reason": s.reason} for s in report.skipped]
        held = {"warmed": report.warmed, "documents": len(documents), "held": mine.entries, "skipped": skipped}
        return {**held, "cache_bytes": mine.nbytes, "cache_max_bytes": store.max_bytes}
