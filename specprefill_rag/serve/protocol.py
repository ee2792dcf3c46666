"""uvicorn's HTTP/1.1 protocol with a deadline on request headers.

uvicorn times out idle keep-alive connections but not a client that trickles its request headers (a
"slowloris"): such a connection stays open forever. Here every connection must complete a request's
headers within ``header_timeout_s`` of connecting or of its previous response, or it is closed.
"""

from __future__ import annotations

import asyncio
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol


class HeaderDeadlineProtocol(H11Protocol):
    """:class:`H11Protocol` closing connections whose next request's headers are overdue."""

    header_timeout_s = 10.0
    _header_deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: Any) -> None:
        super().connection_made(transport)
        self._arm_header_deadline()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        super().connection_lost(exc)

    def _arm_header_deadline(self) -> None:
        if self._header_deadline is not None:
            self._header_deadline.cancel()
        self._header_deadline = self.loop.call_later(self.header_timeout_s, self._headers_overdue, self.cycle)

    def _headers_overdue(self, cycle: Any) -> None:
        """Close the connection if no request began since the deadline was armed (``cycle`` is the request
        then current, None on a new connection) and none is being answered.
        """
        idle = cycle is None or cycle.response_complete
        if self.cycle is cycle and idle and not self.transport.is_closing():
            self.transport.close()


def with_header_timeout(timeout_s: float) -> type[HeaderDeadlineProtocol]:
    """The protocol class for uvicorn's ``http=`` with this deadline."""
    return type("HeaderDeadlineProtocol", (HeaderDeadlineProtocol,), {"header_timeout_s": timeout_s})
