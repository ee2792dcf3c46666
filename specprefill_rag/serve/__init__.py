"""``specprefill-rag serve``: an OpenAI-compatible gateway that runs the draft next to the GPU.

Clients send ordinary OpenAI chat or text completion requests (documents in ``spec_prefill``, in
``document`` content parts, or found by the fallback rule); the gateway scores the prompts of
concurrent requests in batched draft forwards and forwards the compressed requests to the main model
(a vLLM server with this package's plugin, or a transformers model in-process).

Needs the ``serve`` extra (FastAPI, uvicorn, prometheus-client), imported only when an app is built.
"""

from __future__ import annotations

from typing import Any

from .settings import GatewaySettings


def create_app(settings: GatewaySettings | None = None, engine: Any = None) -> Any:
    """The gateway as an ASGI app (see :func:`specprefill_rag.serve.app.create_app`)."""
    try:
        from .app import create_app as build
    except ImportError as error:
        raise ImportError(
            f"the gateway needs FastAPI, uvicorn and prometheus-client ({error}); "
            "install them with: pip install 'specprefill-rag[serve]'"
        ) from error
    return build(settings, engine)


__all__ = ["GatewaySettings", "create_app"]
