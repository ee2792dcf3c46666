"""A stand-in for vLLM's OpenAI server in tests: the JSON replies and model list every stand-in shares."""

import json
from http.server import BaseHTTPRequestHandler


class StandInHandler(BaseHTTPRequestHandler):
    """Answers ``GET`` with one model (``stand-in``, 1,024 positions) and writes JSON replies; subclasses
    answer ``POST`` as the test needs. Quiet: no request log.
    """

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
