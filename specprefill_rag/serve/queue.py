"""The draft queue: requests wait in one bounded queue; those waiting together are scored in one batch.

One worker task takes the waiting prompts (up to ``batch_size`` rows and ``batch_tokens`` padded
tokens, oldest first) and scores them in a worker thread with one batched draft forward. A request
whose caller went away (client disconnect, deadline) leaves the queue at once and is skipped. A batch
that fails as a whole (e.g. out of memory) is retried one prompt at a time, so each request gets its
own result or its own error. A prompt sent with its documents (:class:`DocumentSpans`, in the draft's own
prompt) is scored from the per-document draft cache; the batch function then gets each prompt's documents
(or None) as a second argument, and only then, so a ``score_batch(prompts)`` of one argument still works. A
prompt of a tenant (its cache namespace) likewise gives the batch function each prompt's namespace (or None)
as a third argument.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..draft.assembly import DocumentSpans
from ..draft.importance import DraftScore

# (prompts[, per-prompt spans or None[, per-prompt namespaces or None]]) -> results
ScoreBatch = Callable[..., list["DraftScore | Exception"]]


class QueueFull(Exception):
    """The queue holds ``capacity`` requests; the caller should retry after ``retry_after_s``."""

    def __init__(self, depth: int, retry_after_s: int) -> None:
        super().__init__(f"{depth} requests waiting")
        self.depth = depth
        self.retry_after_s = retry_after_s


@dataclass(frozen=True)
class Scored:
    """One prompt's draft result: ``[L]`` importance, the batch it was scored in and that batch's time,
    the leading tokens the draft's prefix cache supplied, and the document tokens (in how many documents)
    the per-document cache supplied.
    """

    importance: torch.Tensor
    batch_size: int
    draft_ms: float
    cached_tokens: int = 0
    document_cached_tokens: int = 0
    documents_cached: int = 0


@dataclass(eq=False)  # identity: a job is found in the queue by itself, never by comparing tensors
class _Job:
    input_ids: torch.Tensor
    future: asyncio.Future[Scored]
    documents: DocumentSpans | None = None  # for the per-document draft cache
    namespace: str | None = None  # the tenant whose cache entries it may use


class DraftQueue:
    """Bounded FIFO of prompts waiting for the draft.

    Args:
        score_batch: scores a list of ``[L_i]`` prompts (blocking; runs in a worker thread); per prompt its
            importance or its own exception.
        capacity: most requests waiting; one more raises :class:`QueueFull`.
        batch_size: most prompts per batch.
        batch_tokens: most ``rows x longest prompt`` per batch (a longer first prompt still runs, alone).
        window_s: after the first prompt arrives, wait this long for others to batch with it.
    """

    def __init__(self, score_batch: ScoreBatch, capacity: int, batch_size: int, batch_tokens: int, window_s: float):
        self._score_batch = score_batch
        self.capacity, self.batch_size, self.batch_tokens, self.window_s = capacity, batch_size, batch_tokens, window_s
        self._waiting: deque[_Job] = deque()
        self._arrived = asyncio.Event()
        self._worker: asyncio.Task[None] | None = None
        self._recent_batch_s = 0.0
        self._batch_started: float | None = None  # when the batch being scored began
        self.on_batch: Callable[[int, float], None] = lambda size, seconds: None

    @property
    def depth(self) -> int:
        """Requests waiting (not yet taken into a batch)."""
        return len(self._waiting)

    def start(self) -> None:
        if self._worker is None:
            self._worker = asyncio.get_running_loop().create_task(self._run(), name="specprefill-draft-queue")

    async def stop(self) -> None:
        if self._worker is not None:
            self._worker.cancel()
            await asyncio.gather(self._worker, return_exceptions=True)
            self._worker = None

    async def score(
        self, input_ids: torch.Tensor, documents: DocumentSpans | None = None, namespace: str | None = None
    ) -> Scored:
        """Wait for this ``[L]`` prompt's importance. Raises :class:`QueueFull`, or the draft's own error
        for this prompt. Cancelling the caller takes the prompt out of the queue. ``documents``: where its
        documents are, to take their draft KV from the per-document cache (None: drafted jointly);
        ``namespace``: the tenant whose cache entries the draft may use and fills (None: shared).
        """
        if self.depth >= self.capacity:
            raise QueueFull(self.depth, self._retry_after_s())
        self.start()
        job = _Job(input_ids, asyncio.get_running_loop().create_future(), documents, namespace)
        self._waiting.append(job)
        self._arrived.set()
        try:
            return await job.future
        finally:
            if not job.future.done():
                job.future.cancel()
            if job in self._waiting:
                self._waiting.remove(job)

    def _retry_after_s(self) -> int:
        """Seconds until the queue has likely drained enough for one more request: the batches ahead times a
        batch's recent time, or, before any batch has finished, the time the running one has taken so far
        (a lower bound of its length).
        """
        batches_ahead = self.depth / self.batch_size + 1
        batch_s = self._recent_batch_s
        if not batch_s and self._batch_started is not None:
            batch_s = time.perf_counter() - self._batch_started
        return max(1, math.ceil(batches_ahead * batch_s))

    def _take(self) -> list[_Job]:
        batch: list[_Job] = []
        widest = 0
        while self._waiting and len(batch) < self.batch_size:
            job = self._waiting[0]
            width = max(widest, job.input_ids.numel())
            if batch and width * (len(batch) + 1) > self.batch_tokens:
                break
            self._waiting.popleft()
            batch.append(job)
            widest = width
        return batch

    async def _run(self) -> None:
        while True:
            await self._arrived.wait()
            self._arrived.clear()
            while self._waiting:
                if self.window_s > 0:
                    await asyncio.sleep(self.window_s)
                batch = self._take()
                if batch:
                    await self._score(batch)

    async def _score(self, batch: list[_Job]) -> None:
        started = self._batch_started = time.perf_counter()
        try:
            results = await asyncio.to_thread(
                self._score_all,
                [job.input_ids for job in batch],
                [job.documents for job in batch],
                [job.namespace for job in batch],
            )
        finally:
            self._batch_started = None
        seconds = time.perf_counter() - started
        self._recent_batch_s = 0.8 * self._recent_batch_s + 0.2 * seconds if self._recent_batch_s else seconds
        self.on_batch(len(batch), seconds)
        for job, result in zip(batch, results):
            if job.future.done():  # the caller went away meanwhile
                continue
            if isinstance(result, Exception):
                job.future.set_exception(result)
            else:
                job.future.set_result(
                    Scored(
                        result.importance,
                        len(batch),
                        seconds * 1000.0,
                        result.cached_tokens,
                        result.document_cached_tokens,
                        result.documents_cached,
                    )
                )

    def _score_all(
        self, prompts: list[torch.Tensor], documents: list[DocumentSpans | None], namespaces: list[str | None]
    ) -> list[DraftScore | Exception]:
        """Score in one batch; when the batch fails as a whole, one prompt at a time (each its own outcome)."""
        try:
            return self._call(prompts, documents, namespaces)
        except Exception as error:  # e.g. out of memory for the batch; a single prompt may still fit
            if len(prompts) == 1:
                return [error]
        return [self._score_one(*job) for job in zip(prompts, documents, namespaces)]

    def _score_one(
        self, prompt: torch.Tensor, documents: DocumentSpans | None, namespace: str | None
    ) -> DraftScore | Exception:
        try:
            return self._call([prompt], [documents], [namespace])[0]
        except Exception as error:
            return error

    def _call(
        self, prompts: list[torch.Tensor], documents: list[DocumentSpans | None], namespaces: list[str | None]
    ) -> list[DraftScore | Exception]:
        """``score_batch(prompts)``, with ``documents`` as well when any prompt carries spans, and ``namespaces``
        when any prompt has one.
        """
        if any(namespace is not None for namespace in namespaces):
            return self._score_batch(prompts, documents, namespaces)
        if all(spans is None for spans in documents):
            return self._score_batch(prompts)
        return self._score_batch(prompts, documents)
