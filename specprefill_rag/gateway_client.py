"""A client of a SpecPrefill gateway (``specprefill-rag serve``) for the framework adapters.

Torch-free: an application that sends its RAG requests to a gateway loads no model and needs no torch.
Messages go out as OpenAI chat messages (``document`` content parts for documents); the answer comes
back as the same :class:`~specprefill_rag.results.StreamChunk` objects the in-process engine yields,
the last one with the gateway's stats.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncGenerator, Iterator
from dataclasses import dataclass, fields
from typing import Any

import httpx
from pydantic import SecretStr

from .config import GenerationParams
from .errors import InvalidRequestError, SpecPrefillError
from .results import GenerationResult, SpecPrefillStats, StreamChunk


class GatewayClientError(SpecPrefillError):
    """The gateway is unreachable, failed (5xx), or answered something that is not an OpenAI stream."""


_STATS_FIELDS = {f.name for f in fields(SpecPrefillStats)}


@dataclass(frozen=True)
class GatewayReply:
    """One streamed piece: the chunk, and (last chunk only) the gateway's extra stats such as
    ``document_source``, ``n_documents``, ``queue_ms``, ``draft_error``.
    """

    chunk: StreamChunk
    extras: dict[str, Any]


def gateway_card(base_url: str, timeout: float, api_key: str | None = None) -> dict[str, Any] | None:
    """The served model's card when ``base_url`` is a SpecPrefill gateway, None for another OpenAI server
    (e.g. a vLLM server). Raises :class:`GatewayClientError` when nothing answers.
    """
    try:
        response = httpx.get(base_url.rstrip("/") + "/v1/models", headers=_headers(api_key), timeout=timeout)
    except httpx.HTTPError as error:
        raise GatewayClientError(f"cannot reach {base_url} within {timeout:g} s ({error}); check the URL") from None
    if response.status_code in (401, 403):
        raise GatewayClientError(f"{base_url} refused the API key ({response.status_code}); set api_key")
    try:
        card = response.json()["data"][0]
    except (ValueError, KeyError, IndexError, TypeError):
        raise GatewayClientError(f"{base_url}/v1/models is not an OpenAI model list ({response.status_code})") from None
    marker = card.get("spec_prefill") if isinstance(card, dict) else None
    return card if isinstance(marker, dict) and marker.get("gateway") is True else None


def find_gateway(backend: str, timeout: float, api_key: SecretStr | None) -> GatewayClient | None:
    """A client of the SpecPrefill gateway at ``backend``, or None when the answers come from an engine in
    this process: ``backend`` is ``"transformers"`` or another OpenAI server (a vLLM server with the plugin).
    The adapters' one way to decide; raises :class:`GatewayClientError` when a URL does not answer.
    """
    if backend == "transformers":
        return None
    key = api_key.get_secret_value() if api_key else None
    card = gateway_card(backend, timeout, key)
    return GatewayClient(backend, card, timeout, key) if card else None


def engine_here(config: Any, backend: str, timeout: float, is_gateway: bool) -> Any:
    """The process's shared :class:`~specprefill_rag.SpecPrefillEngine` for an adapter's ``config``
    (imports torch); refused when ``backend`` is a gateway (``is_gateway``), whose engine runs there.
    """
    if is_gateway:
        raise InvalidRequestError(f"{backend} is a SpecPrefill gateway: the engine runs there, not here")
    from . import SpecPrefillEngine

    return SpecPrefillEngine.shared(config, backend, timeout)


def api_key_from_environment() -> SecretStr | None:
    """``$SPECPREFILL_API_KEY``, the default API key of the adapters' gateway backend."""
    key = os.environ.get("SPECPREFILL_API_KEY")
    return SecretStr(key) if key else None


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


class GatewayClient:
    """Chat completions from one gateway.

    Args:
        base_url: e.g. ``http://gpu-host:8100``.
        card: its model card (:func:`gateway_card`).
        timeout: seconds to connect and for each read.
        api_key: the gateway's ``--api-key``, if it has one.
    """

    def __init__(self, base_url: str, card: dict[str, Any], timeout: float = 60.0, api_key: str | None = None):
        self.base_url = base_url.rstrip("/")
        self.model = str(card["id"])
        self.context_length = int(card.get("max_model_len") or 0)
        self.timeout = timeout
        self._headers = _headers(api_key)

    def body(self, messages: list[dict[str, Any]], options: dict[str, Any], params: GenerationParams) -> dict[str, Any]:
        """The request: OpenAI chat fields plus ``spec_prefill`` (``options`` with None values left out)."""
        body: dict[str, Any] = {
            "model": self.model,
            "messages": messages,
            "max_tokens": params.max_new_tokens,
            "temperature": params.temperature,
            "top_p": params.top_p,
            "stream": True,
            "spec_prefill": {k: v for k, v in options.items() if v is not None},
        }
        if params.seed is not None:
            body["seed"] = params.seed
        if params.stop:
            body["stop"] = list(params.stop)
        return body

    def stream(self, body: dict[str, Any]) -> Iterator[GatewayReply]:
        """Stream one request (blocking)."""
        url = self.base_url + "/v1/chat/completions"
        reader = _StreamReader()
        try:
            with httpx.stream("POST", url, json=body, headers=self._headers, timeout=self.timeout) as response:
                if response.status_code >= 400:
                    raise _refused(response.status_code, response.read().decode(errors="replace"))
                for line in response.iter_lines():
                    yield from reader.feed(line)
        except httpx.HTTPError as error:
            raise GatewayClientError(f"the gateway at {self.base_url} failed mid-request ({error})") from None
        reader.check_complete(self.base_url)

    async def astream(self, body: dict[str, Any]) -> AsyncGenerator[GatewayReply, None]:
        """Stream one request on the event loop; closing the iterator closes the request."""
        url = self.base_url + "/v1/chat/completions"
        reader = _StreamReader()
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as client:
                async with client.stream("POST", url, json=body, headers=self._headers) as response:
                    if response.status_code >= 400:
                        raise _refused(response.status_code, (await response.aread()).decode(errors="replace"))
                    async for line in response.aiter_lines():
                        for reply in reader.feed(line):
                            yield reply
        except httpx.HTTPError as error:
            raise GatewayClientError(f"the gateway at {self.base_url} failed mid-request ({error})") from None
        reader.check_complete(self.base_url)

    def token_ids(self, text: str) -> list[int]:
        """The main model's token ids of ``text`` (the gateway's ``/tokenize``)."""
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        response = httpx.post(self.base_url + "/tokenize", json=body, headers=self._headers, timeout=self.timeout)
        if response.status_code >= 400:
            raise _refused(response.status_code, response.text)
        return list(response.json()["tokens"])


def _refused(status: int, detail: str) -> SpecPrefillError:
    if 400 <= status < 500:
        return InvalidRequestError(f"the gateway refused the request ({status}): {detail}")
    return GatewayClientError(f"the gateway failed ({status}): {detail}")


class _StreamReader:
    """Server-sent events of a chat completion -> :class:`GatewayReply` objects."""

    def __init__(self) -> None:
        self.text = ""
        self.done = False

    def feed(self, line: str) -> list[GatewayReply]:
        line = line.strip()
        if not line.startswith("data:"):
            return []
        data = line[len("data:") :].strip()
        if data == "[DONE]":
            self.done = True
            return []
        event = json.loads(data)
        if "error" in event:
            error = event["error"]
            raise _refused(int(error.get("code") or 500), str(error.get("message")))
        delta = "".join((c.get("delta") or {}).get("content") or "" for c in event.get("choices", []))
        finish = next((c.get("finish_reason") for c in event.get("choices", []) if c.get("finish_reason")), None)
        self.text += delta
        stats = event.get("spec_prefill")
        if stats is None:
            return [GatewayReply(StreamChunk(delta, []), {})] if delta else []
        return [self._last(delta, finish, stats)]

    def _last(self, delta: str, finish: str | None, stats: dict[str, Any]) -> GatewayReply:
        typed = SpecPrefillStats(**{k: v for k, v in stats.items() if k in _STATS_FIELDS})
        reason = finish if finish in ("stop", "length") else "stop"
        result = GenerationResult(self.text, [], reason, typed, None)  # type: ignore[arg-type]
        extras = {k: v for k, v in stats.items() if k not in _STATS_FIELDS}
        return GatewayReply(StreamChunk(delta, [], result.finish_reason, typed, result), extras)

    def check_complete(self, base_url: str) -> None:
        if not self.done:
            raise GatewayClientError(f"the gateway at {base_url} ended the stream without [DONE]")
