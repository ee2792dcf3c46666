"""Checks that a request left no client thread or socket behind (fault tests, here and in tests/vllm)."""

from __future__ import annotations

import gc
import os
import threading
import time
from contextlib import contextmanager


def client_threads() -> set[threading.Thread]:
    """Live threads, less those of the stand-in HTTP servers the tests run."""
    return {
        t for t in threading.enumerate() if "process_request_thread" not in t.name and "serve_forever" not in t.name
    }


def open_sockets() -> set[str]:
    """File descriptors of this process that are sockets."""
    sockets = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                sockets.add(fd)
        except OSError:  # closed while listing
            pass
    return sockets


@contextmanager
def nothing_left_behind(wait_s: float = 10.0):
    """No thread and no socket opened inside the block may outlive it (waits up to ``wait_s``)."""
    threads, sockets = client_threads(), open_sockets()
    yield
    deadline = time.monotonic() + wait_s
    while True:
        gc.collect()
        extra_threads, extra_sockets = client_threads() - threads, open_sockets() - sockets
        if not (extra_threads or extra_sockets) or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert not extra_threads, f"threads left running: {extra_threads}"
    assert not extra_sockets, f"{len(extra_sockets)} sockets left open"
