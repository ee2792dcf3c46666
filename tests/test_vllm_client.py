"""The vLLM server client against a stand-in HTTP server on 127.0.0.1 (no vLLM needed):
plugin detection, the full-prompt fallback, and what a compressed request carries."""

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from specprefill_rag import SpecPrefillEngine
from specprefill_rag.backends.vllm import PROBE_MARKER, VLLMServerError
from specprefill_rag.positions import cache_salt, decode_runs
from specprefill_rag.testing import random_documents


class StandIn(BaseHTTPRequestHandler):
    """Answers like vLLM's OpenAI server: models, completions (SSE with token_ids), no /tokenize."""

    plugin = False
    bodies: list = []

    def log_message(self, *args):
        pass

    def _json(self, code, payload):
        data = json.dumps(payload).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        self._json(200, {"data": [{"id": "stand-in", "max_model_len": 1024}]})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        if self.path != "/v1/completions":
            return self._json(404, {"error": "not found"})
        if "specprefill_probe" in body.get("vllm_xargs", {}):
            return self._json(400, {"error": {"message": f"{PROBE_MARKER}: probe"}}) if self.plugin else self._json(200, {})
        type(self).bodies.append(body)
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()
        for token in (5, 6, 7):
            chunk = {"choices": [{"index": 0, "text": "", "token_ids": [token]}]}
            self.wfile.write(f"data: {json.dumps(chunk)}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture(params=[False, True], ids=["no-plugin", "plugin"])
def stand_in(request):
    handler = type("Handler", (StandIn,), {"plugin": request.param, "bodies": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}", handler
    server.shutdown()


def test_plugin_detection_and_fallback(stand_in, tiny_model_dir):
    url, handler = stand_in
    settings = {"draft": str(tiny_model_dir), "keep_rate": 0.2, "min_prompt_tokens": 0, "look_ahead": 2}
    if not handler.plugin:
        with pytest.raises(VLLMServerError, match="does not have the specprefill-rag plugin.*full_prompt"):
            SpecPrefillEngine.for_vllm(url, **settings)
    engine = SpecPrefillEngine.for_vllm(url, on_missing_plugin="full_prompt", **settings)
    layout = engine.layout("When?", random_documents(3, 60))
    result = engine.generate_layout(layout)
    assert result.token_ids == [5, 6, 7]
    body = handler.bodies[-1]
    assert result.stats.compressed is handler.plugin
    if not handler.plugin:
        assert body["prompt"] == layout.input_ids.tolist() and "vllm_xargs" not in body
        return
    kept = result.kept_positions
    assert body["prompt"] == layout.input_ids[kept].tolist()
    assert torch.equal(decode_runs(body["vllm_xargs"]["specprefill_runs"]), kept)
    assert body["vllm_xargs"]["specprefill_prompt_length"] == len(layout)
    assert body["cache_salt"] == cache_salt(len(layout), body["vllm_xargs"]["specprefill_runs"])
    assert body["stream"] is True and body["return_token_ids"] is True
