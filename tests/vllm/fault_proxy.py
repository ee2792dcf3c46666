"""A proxy on 127.0.0.1 that puts faults between the client and vLLM's real OpenAI server where the test says.

It relays HTTP/1.1 messages unchanged in both directions (keep-alive included) and reads the framing of each
response (chunked, Content-Length or up to the close), so it knows where a streamed completion's server-sent
events begin and end. A :class:`Fault` armed by the test applies to the next streamed completion (a request whose
JSON body has ``"stream": true``); everything else passes untouched. The fault lands at the point the test chose
however fast or slow the client, the server and the machine are: nothing in it waits for a clock.
"""

from __future__ import annotations

import json
import select
import socket
import socketserver
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from io import BufferedReader
from pathlib import Path
from typing import Literal

_DONE = b"data: [DONE]"
# The proxy's receive buffer on its connection to the server (the kernel doubles it for its bookkeeping). With it,
# what the server can have written beyond what the proxy has read is bounded: see ``server_lead_bytes``.
UPSTREAM_RECEIVE_BUFFER = 64 * 1024
_WRITE_BUFFER = 64 * 1024  # asyncio's default high-water mark: uvicorn stops writing a response beyond it
_READER_BUFFER = 64 * 1024  # the relay's BufferedReader (8 KiB by default) and a chunk in hand, generously


def server_lead_bytes() -> int:
    """At most how many bytes of a response the server can have written that the proxy has not yet read: its
    socket's send buffer (which the kernel grows up to the third value of ``net.ipv4.tcp_wmem``), uvicorn's write
    buffer, and the proxy's receive buffer and reader. However fast the server is, a streamed response longer than
    this is still unfinished, on the server's side, when the proxy has read its first events."""
    send_buffer_max = int(Path("/proc/sys/net/ipv4/tcp_wmem").read_text().split()[2])
    return send_buffer_max + _WRITE_BUFFER + 2 * UPSTREAM_RECEIVE_BUFFER + _READER_BUFFER


@dataclass
class Fault:
    """What happens to the next streamed completion.

    ``after_events=None``: the request is read and never forwarded ("frozen before answering"). Otherwise the
    response is forwarded up to and including its ``after_events``-th ``data:`` event (never ``data: [DONE]``, so
    the cut is mid-stream even if the server sends fewer events), and then, by ``then``:

    - ``"freeze"``: nothing more; the connection stays open until the client gives up ("frozen mid-stream");
    - ``"close"``: the proxy closes the client's connection ("dropped mid-stream");
    - ``"relay"``: ``on_cut()`` runs (e.g. it kills the server), then whatever the server's side of the
      connection still gives is relayed up to its end, so the client sees the server's death as it happened.

    Once the cut is made, ``events`` and ``tokens`` say what had been forwarded and ``cut`` is set.
    """

    after_events: int | None = None
    then: Literal["freeze", "close", "relay"] = "freeze"
    on_cut: Callable[[], object] | None = None
    events: int = 0
    tokens: int = 0
    cut: threading.Event = field(default_factory=threading.Event)


class FaultProxy(socketserver.ThreadingTCPServer):
    """Listens on 127.0.0.1:``port`` (0: any free port) and relays to 127.0.0.1:``upstream_port``.

    One thread per client connection; socketserver names them after ``process_request_thread``, which
    tests/leaks.py counts as a server's, not the client's. A connection whose upstream refuses is closed
    without an answer (the client then reports the server unreachable)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, upstream_port: int, port: int = 0) -> None:
        super().__init__(("127.0.0.1", port), _Relay)
        self.upstream_port = upstream_port
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._fault: Fault | None = None
        self._sockets: set[socket.socket] = set()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def arm(self, fault: Fault) -> Fault:
        """Apply ``fault`` to the next streamed completion; returns it (to read ``cut``, ``tokens``)."""
        with self._lock:
            self._fault = fault
        return fault

    def take_fault(self, body: bytes) -> Fault | None:
        """The armed fault, disarmed, if ``body`` asks for a streamed completion."""
        try:
            streamed = json.loads(body).get("stream") is True
        except (ValueError, AttributeError):
            streamed = False
        with self._lock:
            fault, self._fault = (self._fault, None) if streamed else (None, self._fault)
        return fault

    def connect_upstream(self) -> socket.socket | None:
        """A connection to the server whose receive buffer is fixed at ``UPSTREAM_RECEIVE_BUFFER`` (the kernel
        would otherwise grow it to megabytes while the proxy is not reading); None if the server refuses."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, UPSTREAM_RECEIVE_BUFFER)
        try:
            sock.connect(("127.0.0.1", self.upstream_port))
        except ConnectionRefusedError:
            sock.close()
            return None
        return self.track(sock)

    def track(self, sock: socket.socket) -> socket.socket:
        with self._lock:
            self._sockets.add(sock)
        return sock

    def forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)
        with suppress(OSError):
            sock.close()

    @contextmanager
    def running(self) -> Iterator[FaultProxy]:
        """Serve in a thread; on exit stop, and end every connection still open (a held one included)."""
        thread = threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self.stopping.set()
            self.shutdown()
            with self._lock:
                for sock in self._sockets:
                    with suppress(OSError):
                        sock.shutdown(socket.SHUT_RDWR)
            self.server_close()
            thread.join(timeout=10)


class _Relay(socketserver.BaseRequestHandler):
    """One client connection: each request goes to one upstream connection and its response comes back."""

    server: FaultProxy

    def handle(self) -> None:
        client = self.server.track(self.request)
        upstream: socket.socket | None = None
        readers: list[BufferedReader] = [client.makefile("rb")]
        try:
            while self._client_speaks_first(client, upstream) and (request := _read_message(readers[0])):
                fault = self.server.take_fault(request[1])
                if fault is not None and fault.after_events is None:
                    return self._hold(client, fault)
                if upstream is None:
                    if (upstream := self.server.connect_upstream()) is None:
                        return
                    readers.append(upstream.makefile("rb"))
                upstream.sendall(b"".join(request))
                if not self._respond(readers[1], client, fault) or b"connection: close" in request[0].lower():
                    return
        except OSError:  # either side went away mid-message
            pass
        finally:
            for reader in readers:
                reader.close()
            for sock in (client, upstream):
                if sock is not None:
                    self.server.forget(sock)

    def _client_speaks_first(self, client: socket.socket, upstream: socket.socket | None) -> bool:
        """Wait for the client's next request; False once the server closed an idle kept-alive connection
        (the client must then see its connection closed too) or the proxy stops."""
        watched = [client] if upstream is None else [client, upstream]
        while not self.server.stopping.is_set():
            readable, _, _ = select.select(watched, [], [], 0.1)
            if upstream in readable:
                return False
            if client in readable:
                return True
        return False

    def _respond(self, reader: BufferedReader, client: socket.socket, fault: Fault | None) -> bool:
        """Relay one response; True if the connection may carry another request."""
        head = _read_head(reader)
        if not head:
            return False
        client.sendall(head)
        headers = _headers(head)
        if "chunked" in headers.get("transfer-encoding", ""):
            if fault is not None:
                return self._cut(reader, client, fault)
            for raw, _ in _chunks(reader):
                client.sendall(raw)
        elif "content-length" in headers:
            client.sendall(_read_exactly(reader, int(headers["content-length"])))
        else:
            _copy_to_end(reader, client)
            return False
        return "close" not in headers.get("connection", "")

    def _cut(self, reader: BufferedReader, client: socket.socket, fault: Fault) -> bool:
        """Forward the stream up to the fault's event, then do what it says; the connection then ends."""
        chunks = _chunks(reader)
        while fault.events < fault.after_events:
            raw, payload = next(chunks, (b"", b""))
            if not payload or _DONE in payload:  # the body's end, or its last event
                break
            client.sendall(raw)
            fault.events += sum(line.startswith(b"data:") for line in payload.split(b"\n"))
            fault.tokens += _token_count(payload)
        fault.cut.set()
        if fault.then == "freeze":
            self._hold(client, fault)
        elif fault.then == "relay":
            if fault.on_cut is not None:
                fault.on_cut()
            _copy_to_end(reader, client)
        return False

    def _hold(self, client: socket.socket, fault: Fault) -> None:
        """Keep the connection open and silent until the client closes it (or the proxy stops)."""
        fault.cut.set()
        while not self.server.stopping.is_set():
            readable, _, _ = select.select([client], [], [], 0.1)
            if readable and not client.recv(65536):
                return


def _read_head(reader: BufferedReader) -> bytes:
    """Lines up to and including the blank one that ends a message's head (or a chunked body's trailer);
    b"" if the peer closed before."""
    lines = []
    while (line := reader.readline()) and line not in (b"\r\n", b"\n"):
        lines.append(line)
    return b"".join(lines) + line if line else b""


def _headers(head: bytes) -> dict[str, str]:
    fields = (line.split(b":", 1) for line in head.split(b"\r\n")[1:] if b":" in line)
    return {name.strip().lower().decode(): value.strip().lower().decode() for name, value in fields}


def _read_message(reader: BufferedReader) -> tuple[bytes, bytes] | None:
    """A request's head and body (our clients always send a Content-Length); None if the client closed."""
    head = _read_head(reader)
    if not head:
        return None
    return head, _read_exactly(reader, int(_headers(head).get("content-length", 0)))


def _read_exactly(reader: BufferedReader, size: int) -> bytes:
    data = reader.read(size)
    if len(data) < size:
        raise ConnectionError("the peer closed the connection mid-message")
    return data


def _chunks(reader: BufferedReader) -> Iterator[tuple[bytes, bytes]]:
    """The chunks of a chunked body as (bytes as sent, payload), up to the last one and its trailer."""
    while size_line := reader.readline():
        size = int(size_line.split(b";")[0], 16)
        if size == 0:
            yield size_line + _read_head(reader), b""
            return
        data = _read_exactly(reader, size + 2)
        yield size_line + data, data[:size]


def _token_count(payload: bytes) -> int:
    """Token ids in the completion events of one chunk (vLLM's ``return_token_ids``)."""
    events = [json.loads(line[len(b"data:") :]) for line in payload.split(b"\n") if line.startswith(b"data:")]
    return sum(len(choice.get("token_ids") or []) for event in events for choice in event.get("choices", []))


def _copy_to_end(reader: BufferedReader, client: socket.socket) -> None:
    while data := reader.read1(65536):
        client.sendall(data)
