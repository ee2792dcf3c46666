"""Faults survived: a vLLM server killed mid-stream, hanging, sending malformed events or refusing
connections; the draft out of memory; an async request cancelled midway.

Each gives its documented typed error within the client's timeout, leaves no thread or socket of the
client behind, and the next request on the same engine succeeds. The servers are stand-ins on
127.0.0.1 (tests/vllm/test_faults_vllm.py does the same against vLLM's CPU server).
"""

import asyncio
import json
import select
import signal
import socket
import subprocess
import sys
import threading
import time
import weakref
from contextlib import contextmanager
from functools import partial
from http.server import ThreadingHTTPServer

import pytest
import torch

from specprefill_rag import DraftOutOfMemoryError, SpecPrefillEngine
from specprefill_rag.backends.vllm import VLLMServerError
from specprefill_rag.draft.hooks import decoder_layers
from specprefill_rag.testing import build_model, random_documents
from tests.leaks import nothing_left_behind
from tests.test_vllm_client import StandIn, handler_class

pytestmark = pytest.mark.timeout(120)

PATIENT = 60.0  # the client's timeout wherever it is not what detects the fault: never why a slow machine fails
# The client's timeout for the hanging servers, which it detects by this timeout (each such case waits it out once);
# the next request on that engine gets as long for each read. A stand-in answers from memory in this process: a
# read only waits for a thread to be scheduled, milliseconds even on a busy machine.
TIMEOUT = 2.0
QUESTION = "When did the bridge open?"
SETTINGS = {"keep_rate": 0.2, "min_prompt_tokens": 0, "look_ahead": 2}


class Quiet(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address):
        pass  # a connection the fault tore down on purpose


class FaultyStandIn(StandIn):
    """A stand-in whose next completions each meet the fault popped from ``faults`` (then it serves).

    ``hang-before-headers`` and ``hang-mid-stream`` wait for the client to give up and set
    ``disconnected`` when it closes the connection (that is how the test sees no connection leaks).
    """

    faults: list = []
    release = threading.Event()

    def _send_stream(self):
        fault = self.faults.pop(0) if self.faults else None
        if fault is None:
            return super()._send_stream()
        if fault == "hang-before-headers":
            return self._wait_for_client_to_leave()
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        if fault == "reset-chunked":
            self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        first = f"data: {json.dumps({'choices': [{'index': 0, 'text': '', 'token_ids': [5]}]})}\n\n"
        if fault == "reset-chunked":  # a chunk announced longer than what arrives, then the connection drops
            self.wfile.write(f"{len(first) + 50:x}\r\n{first}".encode())
            return self._reset()
        self.wfile.write(first.encode())
        self.wfile.flush()
        if fault == "hang-mid-stream":
            return self._wait_for_client_to_leave()
        if fault == "malformed-json":
            self.wfile.write(b'data: {"choices": [{"token_ids": [6\n\n')
        elif fault == "malformed-shape":
            self.wfile.write(b'data: {"choices": [{"token_ids": ["six"]}]}\n\n')
        # "drop-mid-stream": the connection closes without data: [DONE], as when the server is stopped

    def _reset(self):
        self.connection.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, (1).to_bytes(4, "little") * 2)
        self.connection.close()

    def _wait_for_client_to_leave(self):
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not self.release.is_set():
            readable, _, _ = select.select([self.connection], [], [], 0.05)
            if readable and not self.connection.recv(1, socket.MSG_PEEK):
                self.disconnected.set()
                return


@contextmanager
def faulty_server(faults, port=0):
    handler = handler_class(FaultyStandIn, plugin=True, faults=list(faults), release=threading.Event())
    server = Quiet(("127.0.0.1", port), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        handler.release.set()
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)


def request(engine, mode, **params):
    """One request, blocking (urllib) or on an event loop (httpx), bounded by a wall-clock limit."""
    documents = random_documents(3, 60)
    if mode == "sync":
        return engine.generate(QUESTION, documents, **params)

    async def bounded():
        return await asyncio.wait_for(engine.agenerate(QUESTION, documents, **params), timeout=30)

    return asyncio.run(bounded())


SERVER_FAULTS = {
    "hang-before-headers": (VLLMServerError, f"cannot reach a vLLM server at .* within {TIMEOUT:g} s"),
    "hang-mid-stream": (VLLMServerError, "failed mid-stream after 1 tokens"),
    "drop-mid-stream": (VLLMServerError, "closed the stream after 1 tokens, before it ended"),
    "reset-chunked": (VLLMServerError, "failed mid-stream after [01] tokens"),
    "malformed-json": (VLLMServerError, "stream event that is not vLLM's \\(JSONDecodeError"),
    "malformed-shape": (VLLMServerError, "stream event that is not vLLM's \\(token id 'six' is not an int"),
}


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("fault", list(SERVER_FAULTS))
def test_server_fault_gives_typed_error_and_next_request_succeeds(fault, mode, tiny_model_dir):
    error, message = SERVER_FAULTS[fault]
    with faulty_server([]) as (url, handler):
        timeout = TIMEOUT if fault.startswith("hang") else PATIENT
        engine = SpecPrefillEngine.for_vllm(url, draft=str(tiny_model_dir), timeout=timeout, **SETTINGS)
        handler.faults.append(fault)
        with nothing_left_behind():
            with pytest.raises(error, match=message):
                request(engine, mode)
            if fault.startswith("hang"):
                assert handler.disconnected.wait(10), "the client kept the hanging connection open"
        assert request(engine, mode).token_ids == [5, 6, 7]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_refused_connection_then_the_restarted_server_serves(mode, tiny_model_dir):
    with faulty_server([]) as (url, _):
        engine = SpecPrefillEngine.for_vllm(url, draft=str(tiny_model_dir), timeout=PATIENT, **SETTINGS)
    port = int(url.rsplit(":", 1)[1])
    with nothing_left_behind():
        with pytest.raises(VLLMServerError, match=f"cannot reach a vLLM server at {url} within"):
            request(engine, mode)
    with faulty_server([], port=port):
        assert request(engine, mode).token_ids == [5, 6, 7]


KILLABLE = """
import json, sys, threading
from http.server import BaseHTTPRequestHandler, HTTPServer

class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def _json(self, code, payload):
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)
    def do_GET(self):
        self._json(200, {"data": [{"id": "killable", "max_model_len": 1024}]})
    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "specprefill_probe" in body.get("vllm_xargs", {}):
            return self._json(400, {"error": {"message": "specprefill-plugin-present: probe"}})
        if self.path != "/v1/completions":
            return self._json(404, {})
        self.send_response(200)
        self.end_headers()
        for token in range(body["max_tokens"]):
            event = json.dumps({"choices": [{"token_ids": [token % 50 + 5]}]})
            self.wfile.write(("data: " + event + "\\n\\n").encode())
            self.wfile.flush()
            if HOLD:  # mid-stream until the test kills this process
                threading.Event().wait()
        self.wfile.write(b"data: [DONE]\\n\\n")

HOLD = sys.argv[2] == "hold"
server = HTTPServer(("127.0.0.1", int(sys.argv[1])), Handler)
print(server.server_address[1], flush=True)
server.serve_forever()
"""


@contextmanager
def killable_server(port=0, hold=False):
    """A stand-in in its own process (killed with SIGKILL by the test); yields ``(url, process)``. With ``hold``
    each stream stops after its first event and waits to be killed, so the kill lands mid-stream however late
    the client reads that event."""
    command = [sys.executable, "-c", KILLABLE, str(port), "hold" if hold else "serve"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    try:
        port = int(process.stdout.readline())
        yield f"http://127.0.0.1:{port}", process
    finally:
        process.kill()
        process.wait(timeout=10)
        process.stdout.close()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_server_process_killed_mid_stream(mode, tiny_model_dir):
    with killable_server(hold=True) as (url, process):
        engine = SpecPrefillEngine.for_vllm(url, draft=str(tiny_model_dir), timeout=PATIENT, **SETTINGS)
        layout = engine.layout(QUESTION, random_documents(3, 60))
        killed = pytest.raises(VLLMServerError, match="(closed the stream|failed mid-stream) after 1 tokens")
        with nothing_left_behind(), killed:
            if mode == "sync":
                for _ in engine.stream_layout(layout):
                    process.send_signal(signal.SIGKILL)
            else:
                asyncio.run(asyncio.wait_for(_kill_after_first_chunk(engine, layout, process), timeout=30))
    with killable_server(int(url.rsplit(":", 1)[1])):  # restarted on the same port
        result = request(engine, mode, max_new_tokens=4)
        assert len(result.token_ids) == 4


async def _kill_after_first_chunk(engine, layout, process):
    async for _ in engine.astream_layout(layout):
        process.send_signal(signal.SIGKILL)


# -- the draft out of memory --------------------------------------------------------------------


@contextmanager
def draft_out_of_memory(model, freed):
    """Make the draft's second decoder layer raise CUDA's out-of-memory error after allocating a
    tensor (``freed`` holds a weak reference to it, to check the failed request's memory is released)."""

    def exhaust(_module, _args):
        scratch = torch.zeros(1 << 20)
        freed.append(weakref.ref(scratch))
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB (simulated)")

    handle = decoder_layers(model)[1].register_forward_pre_hook(exhaust)
    try:
        yield
    finally:
        handle.remove()


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_draft_out_of_memory_fails_that_request_only(mode, tokenizer, tiny_model):
    draft = build_model(tokenizer, layers=2, seed=3)
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, draft, **SETTINGS)
    freed = []
    with nothing_left_behind():
        with draft_out_of_memory(draft, freed), pytest.raises(DraftOutOfMemoryError, match=r"prompt of \d+ tokens"):
            request(engine, mode, max_new_tokens=2)
        assert freed and freed[0]() is None, "the failed request's tensors are still referenced"
    assert draft.config._attn_implementation == "sdpa"  # the scoring hook was removed
    result = request(engine, mode, max_new_tokens=2)
    assert result.stats.compressed and result.stats.draft_ms > 0


# -- an async request cancelled midway -------------------------------------------------------------


async def _cancel_after_first_chunk(make_stream, on_chunk=lambda: None):
    """Consume ``make_stream()`` in a task, calling ``on_chunk()`` at each chunk; cancel the task once the first
    chunk is in and wait until it has ended."""
    started = asyncio.Event()

    async def consume():
        async for _ in make_stream():
            on_chunk()
            started.set()

    task = asyncio.create_task(consume())
    await asyncio.wait_for(started.wait(), timeout=30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


def test_cancelled_async_request_stops_the_in_process_decode(tokenizer, tiny_model):
    """Every forward that starts after the first chunk waits until the task is cancelled: the decode cannot race
    ahead of the cancellation however slow the event loop is, and after it only the forward in flight may run."""
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, **SETTINGS)
    first_chunk, cancelled, forwards = threading.Event(), threading.Event(), []

    def wait_for_the_cancellation(*_):
        if first_chunk.is_set():
            cancelled.wait(30)
            forwards.append(1)

    handle = tiny_model.register_forward_pre_hook(wait_for_the_cancellation)
    documents = random_documents(3, 60)

    async def cancel_midway():
        long_answer = partial(engine.astream, QUESTION, documents, max_new_tokens=700)
        await _cancel_after_first_chunk(long_answer, first_chunk.set)
        cancelled.set()

    try:
        with nothing_left_behind():  # the worker thread has ended too
            asyncio.run(cancel_midway())
        assert len(forwards) <= 1, f"the decode ran on after cancellation ({len(forwards)} forwards)"
    finally:
        handle.remove()
    assert asyncio.run(engine.agenerate(QUESTION, documents, max_new_tokens=3)).stats.completion_tokens > 0


def test_cancelled_async_request_closes_the_server_stream(tiny_model_dir):
    """The stand-in stops after the first event and waits for the client to close the connection (it does not
    race a timed stream against the cancellation)."""
    with faulty_server(["hang-mid-stream"]) as (url, handler):
        engine = SpecPrefillEngine.for_vllm(url, draft=str(tiny_model_dir), timeout=PATIENT, **SETTINGS)
        documents = random_documents(3, 60)

        async def cancel_midway():
            await _cancel_after_first_chunk(partial(engine.astream, QUESTION, documents, max_new_tokens=400))
            return await asyncio.to_thread(handler.disconnected.wait, 10)

        with nothing_left_behind():
            assert asyncio.run(cancel_midway()), "the server's stream stayed open after the request was cancelled"
        assert request(engine, "async").token_ids == [5, 6, 7]
