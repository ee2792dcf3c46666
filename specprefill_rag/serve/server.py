"""Running the gateway: in the foreground (the CLI) or on a background thread (tests, benchmarks)."""

from __future__ import annotations

import socket
import threading
import time
from types import TracebackType
from typing import Any

from .settings import GatewaySettings

_INSTALL_HINT = "the gateway needs FastAPI and uvicorn; install them with: pip install 'specprefill-rag[serve]'"


def _uvicorn() -> Any:
    try:
        import uvicorn
    except ImportError as error:
        raise ImportError(_INSTALL_HINT) from error
    return uvicorn


def uvicorn_config(app: Any, settings: GatewaySettings, **options: Any) -> Any:
    """uvicorn's config for the gateway: HTTP/1.1 with the header deadline, the connection bound."""
    uvicorn = _uvicorn()
    from .protocol import with_header_timeout  # imports uvicorn: only once it is known to be installed

    return uvicorn.Config(
        app, http=with_header_timeout(settings.header_timeout_s), limit_concurrency=settings.max_connections, **options
    )


def run(settings: GatewaySettings, log_level: str = "info") -> None:
    """Serve until interrupted (``specprefill-rag serve``)."""
    from .app import create_app

    config = uvicorn_config(create_app(settings), settings, host=settings.host, port=settings.port, log_level=log_level)
    _uvicorn().Server(config).run()


class BackgroundServer:
    """A gateway app (:func:`~specprefill_rag.serve.create_app`) served by uvicorn on ``127.0.0.1`` (a free port)
    in a daemon thread, with the connection settings ``specprefill-rag serve`` uses.

    Example::

        with BackgroundServer(create_app(settings)) as url:
            openai.OpenAI(base_url=url + "/v1", api_key="none")...
    """

    def __init__(self, app: Any, start_timeout_s: float = 60.0) -> None:
        uvicorn = _uvicorn()
        self._socket = socket.socket()
        self._socket.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._socket.getsockname()[1]}"
        config = uvicorn_config(app, app.state.gateway.settings, log_level="warning", timeout_graceful_shutdown=5)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [self._socket]}, daemon=True)
        self._start_timeout_s = start_timeout_s

    def __enter__(self) -> str:
        self._thread.start()
        deadline = time.monotonic() + self._start_timeout_s
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(f"the gateway did not start within {self._start_timeout_s:g} s")
            time.sleep(0.02)
        return self.url

    def __exit__(
        self, kind: type[BaseException] | None, error: BaseException | None, trace: TracebackType | None
    ) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=30)
        self._socket.close()
