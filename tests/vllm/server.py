"""vLLM's OpenAI server (CPU build) on 127.0.0.1 for the end-to-end tests."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def openai_server(model_folder: Path, start_timeout_s: float = 600) -> Iterator[str]:
    """Serve ``model_folder`` (16-token prefill chunks, eager, float32); yields the base URL."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_folder),
               "--host", "127.0.0.1", "--port", str(port), "--max-model-len", "1024", "--dtype", "float32",
               "--max-num-batched-tokens", "16", "--enforce-eager", "--gpu-memory-utilization", "0.2"]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + start_timeout_s
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"vLLM server exited with {process.returncode}")
            try:
                urllib.request.urlopen(url + "/v1/models", timeout=2).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"vLLM server did not start within {start_timeout_s:g} s") from None
                time.sleep(2)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)
