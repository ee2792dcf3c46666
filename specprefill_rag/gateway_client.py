"""A client of a SpecPrefill gateway (``specprefill-rag serve``) for the framework adapters.

Torch-free: an application that sends its RAG requests to a gateway loads no model and needs no torch.
Messages go out as OpenAI chat messages (``document`` content parts for documents; assistant ``tool_calls``
and ``tool`` results as OpenAI shapes them, :func:`tool_calls_json`); the answer comes back as the same
:class:`~specprefill_rag.results.StreamChunk` objects the in-process engine yields, the last one with the
gateway's stats. The model's tool calls fill ``StreamChunk.tool_calls`` as they complete and the result's
``tool_calls``; calls it wrote that did not decode are the result's ``invalid_tool_calls``. Asked for
(``params.logprobs``), each chunk's and the result's ``logprobs`` come from ``logprobs.content``, without token ids.
"""

from __future__ import annotations

import json
import os
from collections.abc import AsyncGenerator, Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any

import httpx
from pydantic import SecretStr

from .config import MAX_WARM_DOCUMENTS, WARM_DOCUMENTS_PATH, GenerationParams, OutputFormat
from .errors import GatewayClientError, InvalidRequestError, SpecPrefillError
from .results import (
    FinishReason,
    GenerationResult,
    InvalidToolCall,
    SpecPrefillStats,
    StreamChunk,
    TokenLogprob,
    ToolCall,
    TopLogprob,
)

# GatewayClientError lives in errors.py; imported above, it still imports from here (its old home).

_STATS_FIELDS = {f.name for f in fields(SpecPrefillStats)}
_INVALID_CALLS = "invalid_tool_calls"  # spec_prefill's list of the calls that did not decode
_FINISH_REASONS: tuple[FinishReason, ...] = ("stop", "length", "tool_calls")
WarmDocument = str | Mapping[str, Any]
"""A document to warm: its text, or ``{"text", "title", "id"}`` (as in ``spec_prefill.documents``)."""


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


def tool_calls_json(calls: Sequence[ToolCall]) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` in OpenAI's shape (arguments as a JSON object encoded as a string)."""
    return [
        {
            "id": call.id,
            "type": "function",
            "function": {"name": call.name, "arguments": json.dumps(dict(call.arguments), ensure_ascii=False)},
        }
        for call in calls
    ]


def _response_format(output: OutputFormat) -> dict[str, Any]:
    """``response_format`` for a JSON output format."""
    if output.kind == "json_schema":
        schema = {"name": "response", "schema": dict(output.schema or {}), "strict": output.strict}
        return {"type": "json_schema", "json_schema": schema}
    return {"type": "json_object"}


def _decoding_fields(params: GenerationParams, extra: Mapping[str, Any]) -> dict[str, Any]:
    """Request fields for what ``params`` asks of decoding beyond sampling. The gateway derives the tool-call
    markup and a ``tool_choice`` constraint from the ``tools`` and ``tool_choice`` sent (in ``extra``), so
    params that ask for tool calls need them there.
    """
    output = params.output_format
    if (params.tool_format is not None or (output is not None and output.kind == "tool_call")) and "tools" not in extra:
        raise InvalidRequestError(
            "params ask for tool calls (tool_format or a tool_call output_format) but no tools are sent; pass "
            "extra={'tools': [...], 'tool_choice': ...}: the gateway derives the rest"
        )
    fields: dict[str, Any] = {}
    if output is not None and output.kind != "tool_call":
        fields["response_format"] = _response_format(output)
    if not params.parallel_tool_calls:
        fields["parallel_tool_calls"] = False
    return fields


def _merged(body: dict[str, Any], extra: Mapping[str, Any]) -> dict[str, Any]:
    """``body`` with ``extra``'s fields; a field both set to different values is refused, not overwritten."""
    clash = sorted(k for k in extra if k in body and body[k] != extra[k])
    if clash:
        raise InvalidRequestError(
            f"extra sets {clash}, which the other arguments already set to other values; set each field once"
        )
    return {**body, **extra}


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

    def body(
        self,
        messages: list[dict[str, Any]],
        options: dict[str, Any],
        params: GenerationParams,
        extra: Mapping[str, Any] | None = None,
    ) -> dict[str, Any]:
        """The request: OpenAI chat fields plus ``spec_prefill`` (``options`` with None values left out).

        ``extra``: more OpenAI fields, e.g. ``tools``, ``tool_choice``, ``parallel_tool_calls``,
        ``response_format``; ``params.output_format`` (JSON) goes out as ``response_format`` and
        ``parallel_tool_calls=False`` as that field.
        """
        extra = extra or {}
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
        if params.presence_penalty or params.frequency_penalty:
            body.update(presence_penalty=params.presence_penalty, frequency_penalty=params.frequency_penalty)
        if params.logprobs:
            body.update(logprobs=True, top_logprobs=params.top_logprobs)
        return _merged({**body, **_decoding_fields(params, extra)}, extra)

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

    def complete(self, body: dict[str, Any]) -> GatewayReply:
        """One request answered whole (``stream`` false): the reply's chunk carries all text, calls and stats."""
        url = self.base_url + "/v1/chat/completions"
        try:
            response = httpx.post(url, json={**body, "stream": False}, headers=self._headers, timeout=self.timeout)
        except httpx.HTTPError as error:
            raise GatewayClientError(f"the gateway at {self.base_url} failed mid-request ({error})") from None
        if response.status_code >= 400:
            raise _refused(response.status_code, response.text)
        try:
            answer = response.json()
        except ValueError:
            raise GatewayClientError(f"the gateway at {self.base_url} answered something that is not JSON") from None
        return completion_reply(answer)

    def warm_documents(self, documents: Sequence[WarmDocument], instructions: str | None = None) -> dict[str, Any]:
        """Draft ``documents`` into the gateway's per-document draft cache (``POST /v1/spec_prefill/documents/warm``),
        in calls of at most :data:`~specprefill_rag.config.MAX_WARM_DOCUMENTS`. ``instructions``: the system
        message of the requests that will hold them (entries are keyed by the prompt's prefix: other instructions
        find nothing). Returns ``warmed`` (documents now held), ``documents`` (sent), ``skipped`` (each document
        not held: ``{"index", "reason"}``, the index in ``documents``), the ``held`` entries and ``cache_bytes`` of
        this client's tenant (its API key's) and the cache's ``cache_max_bytes``; a 400 (e.g. the gateway has no
        document cache) raises :class:`InvalidRequestError`.
        """
        replies = []
        for body in _warm_calls(documents, instructions):
            try:
                response = httpx.post(
                    self.base_url + WARM_DOCUMENTS_PATH, json=body, headers=self._headers, timeout=self.timeout
                )
            except httpx.HTTPError as error:
                raise GatewayClientError(f"the gateway at {self.base_url} failed mid-request ({error})") from None
            replies.append(_warm_reply(response, self.base_url))
        return _warm_total(replies)

    async def awarm_documents(
        self, documents: Sequence[WarmDocument], instructions: str | None = None
    ) -> dict[str, Any]:
        """:meth:`warm_documents` on the event loop."""
        replies = []
        try:
            async with httpx.AsyncClient(timeout=self.timeout) as client:
                for body in _warm_calls(documents, instructions):
                    response = await client.post(self.base_url + WARM_DOCUMENTS_PATH, json=body, headers=self._headers)
                    replies.append(_warm_reply(response, self.base_url))
        except httpx.HTTPError as error:
            raise GatewayClientError(f"the gateway at {self.base_url} failed mid-request ({error})") from None
        return _warm_total(replies)

    def token_ids(self, text: str) -> list[int]:
        """The main model's token ids of ``text`` (the gateway's ``/tokenize``)."""
        body = {"model": self.model, "prompt": text, "add_special_tokens": False}
        response = httpx.post(self.base_url + "/tokenize", json=body, headers=self._headers, timeout=self.timeout)
        if response.status_code >= 400:
            raise _refused(response.status_code, response.text)
        return list(response.json()["tokens"])


def _warm_calls(documents: Sequence[WarmDocument], instructions: str | None) -> list[dict[str, Any]]:
    """The warm-up request bodies for ``documents``: at most :data:`MAX_WARM_DOCUMENTS` each, in order."""
    if isinstance(documents, (str, bytes, Mapping)) or not isinstance(documents, Sequence) or not documents:
        raise InvalidRequestError(
            f"documents must be a non-empty list of texts or {{'text', 'title', 'id'}} mappings, got "
            f"{type(documents).__name__}; pass a list"
        )
    documents = [dict(d) if isinstance(d, Mapping) else d for d in documents]
    step = MAX_WARM_DOCUMENTS
    return [
        {"documents": documents[i : i + step], "instructions": instructions} for i in range(0, len(documents), step)
    ]


def _warm_total(replies: list[dict[str, Any]]) -> dict[str, Any]:
    """The warm-up replies of one list of documents, summed (``held`` and the cache's bytes: the last reply's;
    each skipped document's index counted in the whole list).
    """
    last, skipped, offset = replies[-1], [], 0
    for reply in replies:
        skipped += [{**entry, "index": entry["index"] + offset} for entry in reply["skipped"]]
        offset += reply["documents"]
    total = {name: sum(int(reply[name]) for reply in replies) for name in ("warmed", "documents")}
    cache = {name: int(last[name]) for name in ("held", "cache_bytes", "cache_max_bytes")}
    return {**total, "skipped": skipped, **cache}


def _warm_reply(response: httpx.Response, base_url: str) -> dict[str, Any]:
    if response.status_code >= 400:
        raise _refused(response.status_code, response.text)
    try:
        reply = response.json()
        counts = {name: int(reply[name]) for name in ("warmed", "documents", "held", "cache_bytes", "cache_max_bytes")}
        skipped = [{"index": int(s["index"]), "reason": str(s["reason"])} for s in reply.get("skipped", [])]
        return {**counts, "skipped": skipped}
    except (ValueError, KeyError, TypeError):
        raise GatewayClientError(f"the gateway at {base_url} answered the warm-up with something else") from None


def _refused(status: int, detail: str) -> SpecPrefillError:
    if 400 <= status < 500:
        return InvalidRequestError(f"the gateway refused the request ({status}): {detail}")
    return GatewayClientError(f"the gateway failed ({status}): {detail}")


def completion_reply(answer: Any) -> GatewayReply:
    """A whole chat completion (``message.content``, ``message.tool_calls``, ``spec_prefill``) as one reply."""
    try:
        choice = answer["choices"][0]
        message, stats = choice["message"], answer["spec_prefill"]
        calls = [{"index": i, **call} for i, call in enumerate(message.get("tool_calls") or [])]
        text = message.get("content") or ""
    except (KeyError, IndexError, TypeError):
        raise GatewayClientError("the gateway's answer is not a chat completion with spec_prefill stats") from None
    reader = _StreamReader()
    reader.text = text
    logprobs = reader.logprobs.feed(choice)
    return reader.last(text, reader.calls.feed(calls), choice.get("finish_reason"), stats, logprobs)


def _top_logprob(entry: Any) -> TopLogprob:
    return TopLogprob(str(entry["token"]), None, float(entry["logprob"]), tuple(entry.get("bytes") or ()))


def _token_logprob(entry: Any) -> TokenLogprob:
    """An entry of ``logprobs.content``; no token id (OpenAI's shape has none)."""
    top = tuple(_top_logprob(alternative) for alternative in entry.get("top_logprobs") or ())
    return TokenLogprob(str(entry["token"]), None, float(entry["logprob"]), tuple(entry.get("bytes") or ()), top)


class _LogprobReader:
    """The choices' ``logprobs.content`` entries -> :class:`TokenLogprob` objects; :attr:`every` stays None
    while no choice carried ``logprobs`` (the request did not ask).
    """

    def __init__(self) -> None:
        self.every: list[TokenLogprob] | None = None

    def feed(self, *choices: Any) -> tuple[TokenLogprob, ...] | None:
        """The entries of these choices (None when none of them has ``logprobs``)."""
        blocks = [choice.get("logprobs") for choice in choices if choice.get("logprobs") is not None]
        if not blocks:
            return None
        try:
            entries = tuple(_token_logprob(entry) for block in blocks for entry in block["content"] or ())
        except (KeyError, TypeError, ValueError, AttributeError):
            problem = f"the gateway's logprobs are not OpenAI's logprobs.content: {str(blocks)[:200]}"
            raise GatewayClientError(problem) from None
        self.every = [*(self.every or []), *entries]
        return entries


class _CallAssembler:
    """Streamed ``delta.tool_calls`` entries -> :class:`ToolCall` objects. The gateway sends each call whole in
    one entry; pieces of one call (same ``index``) are joined, as OpenAI streams them. A call is complete once its
    arguments decode as a JSON object (no longer prefix of an object decodes); one that never does is invalid.
    """

    def __init__(self) -> None:
        self.calls: list[ToolCall] = []
        self._pieces: dict[int, dict[str, str]] = {}
        self._done: set[int] = set()

    def feed(self, entries: Sequence[Any]) -> tuple[ToolCall, ...]:
        """The calls these entries complete."""
        completed = []
        for entry in entries:
            index = entry.get("index") if isinstance(entry, dict) else None
            if not isinstance(index, int) or isinstance(index, bool):
                raise GatewayClientError(f"a streamed tool call has no integer index: {str(entry)[:200]}")
            piece = self._pieces.setdefault(index, {"id": "", "name": "", "arguments": ""})
            function = entry.get("function") or {}
            piece["id"] = entry.get("id") or piece["id"]
            piece["name"] = function.get("name") or piece["name"]
            piece["arguments"] += function.get("arguments") or ""
            call = _decoded(piece) if index not in self._done else None
            if call is not None:
                self._done.add(index)
                completed.append(call)
        self.calls += completed
        return tuple(completed)

    def unfinished(self) -> tuple[InvalidToolCall, ...]:
        """The calls whose arguments never decoded as a JSON object."""
        error = "the arguments are not a JSON object"
        return tuple(
            InvalidToolCall(piece["name"] or None, piece["arguments"], piece["id"], error)
            for index, piece in sorted(self._pieces.items())
            if index not in self._done
        )


def _decoded(piece: dict[str, str]) -> ToolCall | None:
    try:
        arguments = json.loads(piece["arguments"])
    except ValueError:
        return None
    return ToolCall(piece["name"], arguments, piece["id"]) if isinstance(arguments, dict) else None


def _invalid_calls(stats: dict[str, Any]) -> tuple[InvalidToolCall, ...]:
    """``spec_prefill.invalid_tool_calls``: the calls the model wrote that did not decode."""
    try:
        return tuple(
            InvalidToolCall(c.get("name"), str(c["arguments"]), str(c["id"]), str(c["error"]))
            for c in stats.get(_INVALID_CALLS) or ()
        )
    except (KeyError, TypeError, AttributeError):
        raise GatewayClientError(f"spec_prefill.{_INVALID_CALLS} is not a list of invalid calls") from None


class _StreamReader:
    """Server-sent events of a chat completion -> :class:`GatewayReply` objects."""

    def __init__(self) -> None:
        self.text = ""
        self.done = False
        self.calls = _CallAssembler()
        self.logprobs = _LogprobReader()

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
        choices = event.get("choices", [])
        delta = "".join((c.get("delta") or {}).get("content") or "" for c in choices)
        calls = self.calls.feed([e for c in choices for e in (c.get("delta") or {}).get("tool_calls") or []])
        finish = next((c.get("finish_reason") for c in choices if c.get("finish_reason")), None)
        logprobs = self.logprobs.feed(*choices)
        self.text += delta
        stats = event.get("spec_prefill")
        if stats is None:
            chunk = StreamChunk(delta, [], tool_calls=calls, logprobs=logprobs)
            return [GatewayReply(chunk, {})] if delta or calls or logprobs else []
        return [self.last(delta, calls, finish, stats, logprobs)]

    def last(
        self,
        delta: str,
        calls: tuple[ToolCall, ...],
        finish: str | None,
        stats: dict[str, Any],
        logprobs: tuple[TokenLogprob, ...] | None = None,
    ) -> GatewayReply:
        """The last reply: its chunk carries the stats and the whole result."""
        typed = SpecPrefillStats(**{k: v for k, v in stats.items() if k in _STATS_FIELDS})
        reason: FinishReason = next((r for r in _FINISH_REASONS if r == finish), "stop")
        invalid = _invalid_calls(stats) + self.calls.unfinished()
        every = tuple(self.logprobs.every) if self.logprobs.every is not None else None
        result = GenerationResult(self.text, [], reason, typed, None, tuple(self.calls.calls), invalid, every)
        extras = {k: v for k, v in stats.items() if k not in _STATS_FIELDS and k != _INVALID_CALLS}
        return GatewayReply(StreamChunk(delta, [], result.finish_reason, typed, result, calls, logprobs), extras)

    def check_complete(self, base_url: str) -> None:
        if not self.done:
            raise GatewayClientError(f"the gateway at {base_url} ended the stream without [DONE]")
