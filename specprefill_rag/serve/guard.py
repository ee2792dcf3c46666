"""Admission of every HTTP request before a route runs: the key, the JSON content type, the body, read
under a size limit and a deadline, and the concurrency bound.

A request turned away here costs constant work and at most ``max_body_bytes`` of memory: no tokenizer, no model,
no thread. The order is the cheapest refusal first: key (401; ``/metrics`` takes its own key when one is set),
content type (415), declared length (413), a free body reader (429: bodies being received at once, in all and
per client address), then the body as it arrives (413 past the limit, 408 past the deadline), and only then a
request slot (429: in all, and per API key with ``max_requests_per_key``). A request holds a slot only once its
body is complete, so clients that send bodies slowly cannot hold the slots that complete requests need; they
hold body readers, of which one client address gets only a few.
A client that disconnects mid-body is counted as ``disconnected``, not as an error.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, MutableMapping, Sequence
from contextlib import contextmanager
from typing import Any

from ..config import WARM_DOCUMENTS_PATH
from .errors import (
    GatewayError,
    body_too_slow,
    key_overloaded,
    not_json,
    overloaded,
    too_large,
    too_many_bodies,
    unauthorized,
)

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

OPEN_PATHS = frozenset({"/health"})  # answered without a key
UNCOUNTED_PATHS = frozenset({"/health", "/metrics"})  # not counted against the bound
METRICS_PATH = "/metrics"
ENDPOINTS = {  # metric labels
    "/v1/chat/completions": "chat",
    "/v1/completions": "completions",
    WARM_DOCUMENTS_PATH: "warm",
}
_JSON = "application/json"


class _ClientGone(Exception):
    """The client disconnected before its body was complete."""


class Slots:
    """At most ``capacity`` requests in flight, and at most ``per_key`` of them from one API key, with a
    Retry-After estimate for the rest.

    Used from the event loop only (no lock). Little's law: with ``capacity`` requests in flight that each
    stay ``W`` seconds on average, one slot frees about every ``W / capacity`` seconds. Before any request
    has finished, ``W`` is at least the age of the oldest one in flight. A key at its share waits for one of
    its own ``per_key`` requests: about ``W / per_key``.
    """

    def __init__(self, capacity: int, per_key: int | None = None) -> None:
        self.capacity = capacity
        self.per_key = per_key
        self._started: dict[int, float] = {}
        self._by_key: Counter[int] = Counter()
        self._next_id = 0
        self._mean_s: float | None = None

    @property
    def in_flight(self) -> int:
        return len(self._started)

    def of(self, key: int) -> int:
        """The requests in flight from the API key numbered ``key``."""
        return self._by_key[key]

    def retry_after_s(self, sharing: int | None = None) -> int:
        """Seconds until a slot frees, about: among ``sharing`` slots (default: all of them)."""
        now = time.monotonic()
        stay = self._mean_s if self._mean_s is not None else max((now - t for t in self._started.values()), default=0)
        return max(1, math.ceil(stay / (sharing or self.capacity)))

    @contextmanager
    def hold(self, key: int | None = None) -> Iterator[None]:
        """One slot for the body of the ``with``, for the API key numbered ``key`` (None: a gateway without
        keys, one client); raises a 429 :class:`GatewayError` when none is free.
        """
        if key is not None and self.per_key is not None and self._by_key[key] >= self.per_key:
            raise key_overloaded(self.per_key, self.retry_after_s(self.per_key))
        if self.in_flight >= self.capacity:
            raise overloaded(self.capacity, self.retry_after_s())
        slot, self._next_id = self._next_id, self._next_id + 1
        self._started[slot] = time.monotonic()
        if key is not None:
            self._by_key[key] += 1
        try:
            yield
        finally:
            stayed = time.monotonic() - self._started.pop(slot)
            self._mean_s = stayed if self._mean_s is None else 0.9 * self._mean_s + 0.1 * stayed
            if key is not None:
                self._by_key[key] -= 1
                if not self._by_key[key]:
                    del self._by_key[key]


class BodyReaders:
    """Bodies being received: at most ``capacity`` at once, and at most ``per_client`` from one client address.

    Used from the event loop only (no lock). What a body holds until it is complete is one of these, never a
    request slot, and a client address sending many bodies slowly holds ``per_client`` of them at most. The
    gateway's ``capacity`` is ``max_connections``: a lower one would be a bound that fewer addresses could hold
    than it takes to hold every connection.
    """

    def __init__(self, capacity: int, per_client: int) -> None:
        self.capacity = capacity
        self.per_client = per_client
        self._by_client: Counter[str] = Counter()

    @property
    def reading(self) -> int:
        return self._by_client.total()

    def of(self, client: str) -> int:
        """The bodies being received from ``client`` now."""
        return self._by_client[client]

    @contextmanager
    def hold(self, client: str) -> Iterator[None]:
        """One reader for the body of the ``with``; raises a 429 :class:`GatewayError` when none is free."""
        if self._by_client[client] >= self.per_client:
            raise too_many_bodies(self.per_client, "from this client address")
        if self.reading >= self.capacity:
            raise too_many_bodies(self.capacity, "in all")
        self._by_client[client] += 1
        try:
            yield
        finally:
            self._by_client[client] -= 1
            if not self._by_client[client]:
                del self._by_client[client]


def _client(scope: Scope) -> str:
    """The client's address (its host, without the port); ``""`` when the server does not know it."""
    client = scope.get("client")
    return str(client[0]) if client else ""


def _header(scope: Scope, name: bytes) -> bytes | None:
    for key, value in scope["headers"]:
        if key == name:
            return bytes(value)
    return None


def bearer_matches(header: bytes | None, key: bytes) -> bool:
    """``Authorization: Bearer <key>``, the scheme in any case (RFC 9110), the key compared in constant time."""
    scheme, _, token = (header or b"").partition(b" ")
    return scheme.lower() == b"bearer" and hmac.compare_digest(token.lstrip(b" "), key)


def matched_key(header: bytes | None, keys: Sequence[bytes]) -> int | None:
    """The number of the key in ``keys`` the header carries, None if none (all compared, each in constant time)."""
    matches = [bearer_matches(header, key) for key in keys]
    return matches.index(True) if any(matches) else None


def _media_type(header: bytes | None) -> str:
    return (header or b"").decode("latin-1").split(";", 1)[0].strip().lower()


async def read_body(receive: Receive, limit: int, timeout_s: float) -> bytes:
    """The whole body, or a 413 past ``limit`` bytes / a 408 past ``timeout_s`` (what arrived is dropped)."""
    chunks, size = [], 0
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            message = await asyncio.wait_for(receive(), max(deadline - time.monotonic(), 0.0))
        except asyncio.TimeoutError:
            raise body_too_slow(timeout_s) from None
        if message["type"] == "http.disconnect":
            raise _ClientGone
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > limit:
            raise too_large(limit)
        chunks.append(chunk)
        if not message.get("more_body", False):
            return b"".join(chunks)


def _replay(body: bytes, receive: Receive) -> Receive:
    """A ``receive`` that hands the app the body already read, then the client's later messages
    (its disconnect).
    """
    pending = [{"type": "http.request", "body": body, "more_body": False}]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed


async def send_error(send: Send, error: GatewayError) -> None:
    """Answer with the gateway's JSON error body."""
    body = json.dumps(error.body()).encode()
    headers = [(b"content-type", _JSON.encode()), (b"content-length", str(len(body)).encode())]
    headers += [(name.lower().encode(), value.encode()) for name, value in error.headers.items()]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestGuard:
    """ASGI middleware admitting requests (see the module docstring).

    Args:
        app: the routes.
        api_keys: the Bearer keys accepted (each its own tenant); none: an open gateway.
        slots: the concurrency bound (taken once the body is complete).
        readers: the bound on bodies being received.
        max_body_bytes: largest body.
        body_timeout_s: deadline of the whole body, from the headers.
        count: ``count(endpoint, outcome)`` for refused completion requests (metrics).
        metrics_keys: the keys of ``/metrics``; none: ``api_keys``.
    """

    def __init__(
        self,
        app: ASGIApp,
        api_keys: Sequence[str],
        slots: Slots,
        readers: BodyReaders,
        max_body_bytes: int,
        body_timeout_s: float,
        count: Callable[[str, str], None],
        metrics_keys: Sequence[str] = (),
    ) -> None:
        self.app = app
        self._keys = tuple(key.encode() for key in api_keys)
        self._metrics_keys = tuple(key.encode() for key in metrics_keys) or self._keys
        self.slots = slots
        self.readers = readers
        self.max_body_bytes = max_body_bytes
        self.body_timeout_s = body_timeout_s
        self._count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        endpoint = ENDPOINTS.get(scope["path"])
        keys = self._metrics_keys if scope["path"] == METRICS_PATH else self._keys
        try:
            key = matched_key(_header(scope, b"authorization"), keys) if keys else None
            if keys and key is None:
                raise unauthorized()
            if scope["path"] in UNCOUNTED_PATHS:
                await self.app(scope, receive, send)
                return
            if scope["method"] == "POST":
                receive = _replay(await self._body(scope, receive), receive)
            with self.slots.hold(key):
                await self.app(scope, receive, send)
        except GatewayError as error:
            if endpoint is not None:
                self._count(endpoint, error.outcome)
            await send_error(send, error)
        except _ClientGone:
            if endpoint is not None:
                self._count(endpoint, "disconnected")

    async def _body(self, scope: Scope, receive: Receive) -> bytes:
        content_type = _header(scope, b"content-type")
        if _media_type(content_type) != _JSON:
            raise not_json((content_type or b"").decode("latin-1"))
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit() and (len(declared) > 18 or int(declared) > self.max_body_bytes):
            raise too_large(self.max_body_bytes)
        with self.readers.hold(_client(scope)):
            return await read_body(receive, self.max_body_bytes, self.body_timeout_s)
