"""Bounded workers for the gateway's heavy work, apart from the threads that serve ordinary requests.

Compiling an output grammar and drafting documents for the warm-up endpoint each take seconds of a thread that
cannot be interrupted. Run on the event loop's default executor (``asyncio.to_thread``), six of them held every
thread that tokenizes and lays out ordinary requests, which then waited 41-212 s (issue #43). Each kind of heavy
work gets its own :class:`Workers`: a fixed number of threads and a bounded queue; past it, a request is refused
at once (:class:`WorkersBusy`, a 503 with ``Retry-After``) instead of waiting.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")
THREAD_PREFIX = "specprefill-"


class WorkersBusy(Exception):
    """Every thread of a :class:`Workers` is busy and its queue is full."""

    def __init__(self, name: str, threads: int, queue: int) -> None:
        super().__init__(f"the {name} workers are busy ({threads} running, {queue} waiting)")
        self.name = name
        self.threads = threads
        self.queue = queue


class Workers:
    """``threads`` threads (named ``specprefill-<name>_<i>``) and at most ``queue`` jobs waiting for them.

    Args:
        name: what the work is, in thread names and errors (``"grammar"``, ``"warm"``).
        threads: threads running jobs at once, at least 1.
        queue: jobs waiting for a thread at most (0: none wait).
    """

    def __init__(self, name: str, threads: int, queue: int) -> None:
        if threads < 1 or queue < 0:
            raise ValueError(f"{name} workers need at least 1 thread and a queue of 0 or more; got {threads}, {queue}")
        self.name = name
        self.threads = threads
        self.queue = queue
        self._executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix=f"{THREAD_PREFIX}{name}")
        self._lock = threading.Lock()
        self._pending = 0  # jobs running or waiting

    @property
    def pending(self) -> int:
        """Jobs running or waiting now."""
        with self._lock:
            return self._pending

    def submit(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> asyncio.Future[T]:
        """Run ``fn(*args, **kwargs)`` on a worker thread; the awaitable of its result, on the running loop.

        :class:`WorkersBusy` at once when ``threads + queue`` jobs are already running or waiting. Cancelling the
        awaitable drops a job that has not started; one that has runs to its end (a thread cannot be interrupted),
        holding its place meanwhile, so the bound holds.
        """
        with self._lock:
            if self._pending >= self.threads + self.queue:
                raise WorkersBusy(self.name, self.threads, self.queue)
            self._pending += 1
        try:
            job: Future[T] = self._executor.submit(fn, *args, **kwargs)
        except BaseException:
            self._release(None)
            raise
        job.add_done_callback(self._release)
        return asyncio.wrap_future(job)

    def _release(self, _: Future[Any] | None) -> None:
        with self._lock:
            self._pending -= 1

    def shutdown(self) -> None:
        """Stop taking jobs; those waiting are dropped, those running finish on their own."""
        self._executor.shutdown(wait=False, cancel_futures=True)
