"""Async access to the blocking engine without blocking the event loop."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncGenerator, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")
_DONE = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


async def iterate_in_thread(make_iterator: Callable[[], Iterator[T]]) -> AsyncGenerator[T, None]:
    """Run a blocking iterator in a worker thread and yield its items on the event loop.

    Exceptions from the iterator are re-raised here; if the consumer stops early, the worker
    closes the iterator at its next item instead of running it to the end.
    """
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[object] = asyncio.Queue()
    cancelled = threading.Event()

    def post(item: object) -> None:
        try:
            loop.call_soon_threadsafe(queue.put_nowait, item)
        except RuntimeError:  # the loop has closed: the consumer stopped early and is gone
            cancelled.set()

    def pump() -> None:
        iterator = make_iterator()
        try:
            for item in iterator:
                post(item)
                if cancelled.is_set():
                    break
        except BaseException as error:  # handed to the consumer, which re-raises it
            post(_Failure(error))
        finally:
            close = getattr(iterator, "close", None)
            if close is not None:
                close()
            post(_DONE)

    worker = threading.Thread(target=pump, name="specprefill-stream", daemon=True)
    worker.start()
    try:
        while (item := await queue.get()) is not _DONE:
            if isinstance(item, _Failure):
                raise item.error
            yield item  # type: ignore[misc]
    finally:
        cancelled.set()
