"""The server client's prefill report from vLLM's usage event, against a stand-in server (no engine):
cached tokens when the usage counts them, None when it does not; the usage-only event carries no tokens,
and after an end-of-sequence token the client reads on only to that event."""

import json
import threading
from http.server import ThreadingHTTPServer

import pytest
import torch

from specprefill_rag.backends.base import SparsePrompt
from specprefill_rag.backends.vllm import VLLMServerBackend, sse_tokens
from specprefill_rag.backends.vllm_wire import VLLMServerError
from specprefill_rag.config import GenerationParams
from specprefill_rag.positions import POSITION_KEYED_BLOCKS, PROBE_MARKER
from specprefill_rag.results import PrefillReport

from ..stand_in import StandInHandler

USAGE = {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5}


def event(payload) -> bytes:
    return f"data: {json.dumps(payload)}\n\n".encode()


def token(t: int) -> bytes:
    return event({"choices": [{"index": 0, "text": "", "token_ids": [t]}]})


class StandIn(StandInHandler):
    lines: list[bytes] = []
    probe_answer = PROBE_MARKER
    bodies: list = []

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if "specprefill_probe" in body.get("vllm_xargs", {}):
            return self._json(400, {"error": {"message": self.probe_answer}})
        type(self).bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for line in self.lines:
            self.wfile.write(line)
            self.wfile.flush()


@pytest.fixture
def stand_in():
    servers = []

    def start(lines, probe_answer=PROBE_MARKER):
        handler = type("Handler", (StandIn,), {"lines": lines, "probe_answer": probe_answer, "bodies": []})
        server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers.append(server)
        return VLLMServerBackend(f"http://127.0.0.1:{server.server_address[1]}", frozenset({9})), handler

    yield start
    for server in servers:
        server.shutdown()


SPARSE = SparsePrompt(torch.tensor([5, 6, 7]), torch.tensor([0, 4, 9]), 10)
PARAMS = GenerationParams(max_new_tokens=4)


def test_usage_event_parsing():
    report = PrefillReport()
    details = {**USAGE, "prompt_tokens_details": {"cached_tokens": 2}}
    assert sse_tokens(event({"choices": [], "usage": details}), frozenset(), report).tokens == []
    assert report.cached_tokens == 2
    assert sse_tokens(event({"usage": USAGE}), frozenset(), report).tokens == []  # no details: left as it was
    assert report.cached_tokens == 2 and PrefillReport().cached_tokens is None
    assert sse_tokens(event({"choices": [], "usage": details}), frozenset()).tokens == []  # no report asked for
    with pytest.raises(VLLMServerError, match="not vLLM's"):
        sse_tokens(event({"no": "choices"}), frozenset(), report)


@pytest.mark.parametrize("details", [True, False], ids=["with-details", "without-details"])
def test_report_from_the_usage_event_after_end_of_sequence(stand_in, details):
    usage = {**USAGE, "prompt_tokens_details": {"cached_tokens": 128}} if details else USAGE
    lines = [token(5), token(9), event({"choices": [], "usage": usage}), b"data: [DONE]\n\n"]
    backend, handler = stand_in(lines, f"{PROBE_MARKER}: refused; capabilities: {POSITION_KEYED_BLOCKS}")
    assert backend.position_keyed_blocks
    report = PrefillReport()
    assert list(backend.generate(SPARSE, PARAMS, report)) == [5]
    assert report.cached_tokens == (128 if details else None)
    assert "cache_salt" not in handler.bodies[-1]


def test_an_old_plugin_gets_the_salt_and_a_server_generating_past_eos_is_not_waited_for(stand_in):
    lines = [token(5), token(9), token(6), token(7), b"data: [DONE]\n\n"]  # the server does not stop at 9
    backend, handler = stand_in(lines)
    assert backend.supports_sparse_prefill and not backend.position_keyed_blocks
    report = PrefillReport()
    assert list(backend.generate(SPARSE, PARAMS, report)) == [5] and report.cached_tokens is None
    assert "cache_salt" in handler.bodies[-1]
