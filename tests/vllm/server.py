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


def server_command(model_folder: Path, port: int, *options: str) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server`` for ``model_folder`` on 127.0.0.1:``port`` (eager,
    float32, a small share of memory), with ``options`` added."""
    return [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model_folder),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        "float32",
        "--enforce-eager",
        "--gpu-memory-utilization",
        "0.2",
        *options,
    ]


def wait_until_serving(process: subprocess.Popen, url: str, limit_s: float = 600) -> None:
    """Return once ``url`` answers /v1/models; raise if the server exits or ``limit_s`` passes first."""
    deadline = time.monotonic() + limit_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"vLLM server exited with {process.returncode}")
        try:
            urllib.request.urlopen(url + "/v1/models", timeout=2).read()
            return
        except OSError:
            time.sleep(2)
    raise RuntimeError(f"vLLM server did not start within {limit_s:g} s")


@contextmanager
def openai_server(model_folder: Path, start_timeout_s: float = 600) -> Iterator[str]:
    """Serve ``model_folder`` (16-token prefill chunks, 1,024-token context, prefix caching on by default,
    cached prompt tokens in the usage); yields the base URL."""
    port = free_port()
    command = server_command(
        model_folder,
        port,
        "--max-model-len",
        "1024",
        "--max-num-batched-tokens",
        "16",
        "--enable-prompt-tokens-details",
    )
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_until_serving(process, url, start_timeout_s)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=60)
