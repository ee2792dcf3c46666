"""A request's stream, and the entry points derived from a streaming one.

Each of the engine's input forms (a question over documents, a layout, a chat) is written once, as a blocking
stream method returning a :class:`RequestStream`; its whole-answer and event-loop forms are derived here, with
the same (typed) arguments: :func:`answered`, :func:`on_loop`, :func:`answered_on_loop`.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import AsyncGenerator, Callable, Coroutine, Generator, Iterator
from typing import Any, ParamSpec

from ..results import GenerationResult, StreamChunk
from .stream import alast_result, last_result

P = ParamSpec("P")


class RequestStream(Iterator[StreamChunk]):
    """A request checked and planned before any model ran (bad input has been refused): iterate it to answer in
    this thread, the last chunk carrying the stats and full result; or take :meth:`on_loop` to answer on an event
    loop instead. :meth:`close` stops early and ends the main model's request.
    """

    def __init__(
        self,
        run: Callable[[], Generator[StreamChunk, None, None]],
        run_on_loop: Callable[[], AsyncGenerator[StreamChunk, None]],
    ) -> None:
        self._run, self._run_on_loop = run, run_on_loop
        self._chunks: Generator[StreamChunk, None, None] | None = None

    def __next__(self) -> StreamChunk:
        if self._chunks is None:
            self._chunks = self._run()
        return next(self._chunks)

    def close(self) -> None:
        """Stop: the backend's request ends (nothing runs if it never started)."""
        if self._chunks is not None:
            self._chunks.close()

    def on_loop(self) -> AsyncGenerator[StreamChunk, None]:
        """The same request answered on an event loop: draft scoring in a worker thread, tokens from the backend's
        async interface (over HTTP for a vLLM server: no thread per request). Take it instead of iterating.
        """
        return self._run_on_loop()


def answered(stream: Callable[P, RequestStream]) -> Callable[P, GenerationResult]:
    """The entry point that runs ``stream`` to its end: its arguments, the result its last chunk carries."""

    @functools.wraps(stream, assigned=())
    def answer(*args: P.args, **kwargs: P.kwargs) -> GenerationResult:
        return last_result(stream(*args, **kwargs))

    return _named(answer, stream, "answers to the end")


def on_loop(stream: Callable[P, RequestStream]) -> Callable[P, AsyncGenerator[StreamChunk, None]]:
    """The entry point that answers ``stream``'s request on an event loop (the prompt is laid out on the loop;
    close the generator, ``aclose``, to stop early: that ends the main model's request).
    """

    @functools.wraps(stream, assigned=())
    def stream_on_loop(*args: P.args, **kwargs: P.kwargs) -> AsyncGenerator[StreamChunk, None]:
        return stream(*args, **kwargs).on_loop()

    return _named(stream_on_loop, stream, "streams on an event loop")


def answered_on_loop(stream: Callable[P, RequestStream]) -> Callable[P, Coroutine[Any, Any, GenerationResult]]:
    """The entry point that answers ``stream``'s request to its end on an event loop."""

    @functools.wraps(stream, assigned=())
    async def answer_on_loop(*args: P.args, **kwargs: P.kwargs) -> GenerationResult:
        return await alast_result(stream(*args, **kwargs).on_loop())

    return _named(answer_on_loop, stream, "answers to the end on an event loop")


def _named(method: Any, stream: Callable[..., Any], what: str) -> Any:
    """``method`` documented as derived from ``stream``, with its arguments (``inspect.signature``, ``help``)."""
    method.__doc__ = f":meth:`{stream.__name__}`, which it {what}; the same arguments."
    method.__signature__ = inspect.signature(stream).replace(return_annotation=inspect.Signature.empty)
    return method
