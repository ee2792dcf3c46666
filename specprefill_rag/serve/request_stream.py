"""One HTTP request's stream of answers, bounded by its deadline and ended when the client goes away.

Every step waits for the next answer chunk, the client's disconnect and the deadline at once: a
client that disconnects while its request waits for the draft or the main model cancels that wait
(which frees its queue slot and closes the upstream request); a passed deadline answers 504.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncGenerator
from typing import Any

from .errors import ClientGone, deadline_exceeded
from .gateway import Answer

__all__ = ["ClientGone", "RequestStream", "client_gone"]


async def client_gone(request: Any) -> None:
    """Return when the ASGI server reports that the client disconnected (the body was read already)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class RequestStream:
    """The answers of one request, step by step.

    Args:
        answers: :meth:`Gateway.answer` for the request.
        request: the Starlette request (for disconnects).
        timeout_s: the request's deadline.
        spent_s: the seconds of it already spent (reading, laying out, compiling its grammar); the rest counts
            from now.
    """

    def __init__(
        self, answers: AsyncGenerator[Answer, None], request: Any, timeout_s: float, spent_s: float = 0.0
    ) -> None:
        self._answers = answers
        self._timeout_s = timeout_s
        self._deadline = time.monotonic() + timeout_s - spent_s
        self._watch = asyncio.ensure_future(client_gone(request))
        self._step: asyncio.Future[Answer] | None = None
        self._started = False

    async def next(self) -> Answer | None:
        """The next answer chunk, or None at the end. Raises :class:`ClientGone`, a 504
        :class:`GatewayError` past the deadline, or the request's own error.
        """
        step = self._step = asyncio.ensure_future(self._answers.__anext__())
        remaining = max(self._deadline - time.monotonic(), 0.0)
        done, _ = await asyncio.wait({step, self._watch}, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
        if step in done:
            try:
                answer = step.result()
            except StopAsyncIteration:
                return None
            self._started = True
            return answer
        step.cancel()
        await asyncio.gather(step, return_exceptions=True)
        if self._watch in done:
            raise ClientGone
        phase = "streaming the answer" if self._started else "waiting for the draft and the first token"
        raise deadline_exceeded(self._timeout_s, phase)

    async def close(self) -> None:
        """Stop watching and end the answer stream (closes the main model's request). Call it shielded
        from cancellation: it runs when the response task is being cancelled (client gone).
        """
        pending = [task for task in (self._watch, self._step) if task is not None and not task.done()]
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
        await self._answers.aclose()
