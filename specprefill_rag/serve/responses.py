"""Response bodies in vLLM's OpenAI shapes: whole answers and server-sent-event chunks.

The chat and text endpoints differ only in object names and the shape of a choice; each is a
:class:`ApiFormat`. Every answer carries ``spec_prefill`` (the stats) in its last chunk or body, and
``usage.prompt_tokens`` counts the full prompt, not the kept tokens.

Tool calls go out in OpenAI's shapes: ``message.tool_calls`` (``content`` null when the model wrote only calls)
or, streamed, one ``delta.tool_calls`` entry per completed call (``index`` counts the answer's calls), and
``finish_reason`` ``"tool_calls"``. Calls the model wrote that did not decode are in the last chunk's or the
body's ``spec_prefill.invalid_tool_calls`` (whenever tool calls were parsed), never dropped.

Log-probabilities, when asked: a chat choice's ``logprobs.content`` (OpenAI's entries: ``token``, ``logprob``,
``bytes``, ``top_logprobs``), streamed as each chunk's tokens'; a text completion's legacy ``logprobs``
(``tokens``, ``token_logprobs``, ``top_logprobs``, ``text_offset``). Not asked: ``logprobs`` is null.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from ..config import GenerationParams
from ..results import InvalidToolCall, StreamChunk, TokenLogprob, ToolCall, chat_logprobs, legacy_logprobs


def tool_call_json(call: ToolCall) -> dict[str, Any]:
    """A call in OpenAI's shape: the arguments as a JSON object encoded as a string."""
    arguments = json.dumps(dict(call.arguments), ensure_ascii=False)
    return {"id": call.id, "type": "function", "function": {"name": call.name, "arguments": arguments}}


def invalid_tool_call_json(call: InvalidToolCall) -> dict[str, Any]:
    """A call that did not decode: its name (if read), raw arguments text, id and why."""
    return {"name": call.name, "arguments": call.arguments, "id": call.id, "error": call.error}


def with_invalid_calls(
    spec_prefill: dict[str, Any] | None, chunk: StreamChunk, params: GenerationParams
) -> dict[str, Any] | None:
    """The last chunk's ``spec_prefill`` with the answer's undecodable calls, when tool calls were parsed."""
    if spec_prefill is None or chunk.result is None or params.tool_format is None:
        return spec_prefill
    invalid = [invalid_tool_call_json(call) for call in chunk.result.invalid_tool_calls]
    return {**spec_prefill, "invalid_tool_calls": invalid}


@dataclass(frozen=True)
class ApiFormat:
    """Object names and choice shapes of one endpoint."""

    object_name: str
    chunk_name: str
    id_prefix: str
    is_chat: bool

    def choice(
        self,
        text: str,
        finish_reason: str | None,
        tool_calls: Sequence[ToolCall] = (),
        logprobs: Sequence[TokenLogprob] | None = None,
        text_offset: int = 0,
    ) -> dict[str, Any]:
        """A whole answer's choice; a chat message's ``content`` is null when the model wrote only calls.
        ``logprobs``: its tokens' (None: not asked); ``text_offset``: where a text completion's chunk starts.
        """
        if self.is_chat:
            message: dict[str, Any] = {"role": "assistant", "content": text if text or not tool_calls else None}
            if tool_calls:
                message["tool_calls"] = [tool_call_json(call) for call in tool_calls]
            return {"index": 0, "message": message, "finish_reason": finish_reason, "logprobs": chat_logprobs(logprobs)}
        logprobs_json = legacy_logprobs(logprobs, text_offset)
        return {"index": 0, "text": text, "finish_reason": finish_reason, "logprobs": logprobs_json}

    def delta(
        self,
        text: str,
        finish_reason: str | None,
        first: bool,
        tool_calls: Sequence[ToolCall] = (),
        call_index: int = 0,
        logprobs: Sequence[TokenLogprob] | None = None,
        text_offset: int = 0,
    ) -> dict[str, Any]:
        """A streamed choice; ``call_index``: the answer's calls sent before this chunk's; ``logprobs``: this
        chunk's tokens'; ``text_offset``: the text completion's tokens' text before this chunk.
        """
        if not self.is_chat:
            return self.choice(text, finish_reason, logprobs=logprobs, text_offset=text_offset)
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text or not tool_calls:
            delta["content"] = text
        if tool_calls:
            delta["tool_calls"] = [
                {"index": call_index + number, **tool_call_json(call)} for number, call in enumerate(tool_calls)
            ]
        return {"index": 0, "delta": delta, "finish_reason": finish_reason, "logprobs": chat_logprobs(logprobs)}


CHAT = ApiFormat("chat.completion", "chat.completion.chunk", "chatcmpl-", is_chat=True)
TEXT = ApiFormat("text_completion", "text_completion", "cmpl-", is_chat=False)


# The selection's stats go out as response headers too, before the first token (so on streams as well):
# clients that drop the body's unknown ``spec_prefill`` field (LangChain's ChatOpenAI) still show them.
HEADER_PREFIX = "x-specprefill-"
HEADER_FIELDS = (
    "compressed",
    "uncompressed_reason",
    "prompt_tokens",
    "document_tokens",
    "kept_tokens",
    "kept_document_tokens",
    "keep_rate",
    "keep_policy",
    "draft_ms",
    "draft_path",
    "draft_cached_tokens",
    "draft_document_cached_tokens",
    "draft_documents_cached",
    "reused_spans",
    "queue_ms",
    "draft_batch_size",
    "document_source",
    "n_documents",
)
HEADER_NAMES = tuple(HEADER_PREFIX + name.replace("_", "-") for name in HEADER_FIELDS)


def stats_headers(known: dict[str, Any]) -> dict[str, str]:
    """``x-specprefill-*`` headers from the stats known before the first token; absent values are left out."""
    headers = {}
    for name, header in zip(HEADER_FIELDS, HEADER_NAMES):
        value = known.get(name)
        if value is None:
            continue
        if isinstance(value, bool):
            headers[header] = "true" if value else "false"
        elif isinstance(value, float):
            headers[header] = f"{value:.4g}" if name == "keep_rate" else f"{value:.1f}"
        else:
            headers[header] = str(value)
    return headers


def usage(stats: Any) -> dict[str, int]:
    """OpenAI usage from :class:`SpecPrefillStats`: the full prompt's tokens, not the kept ones."""
    return {
        "prompt_tokens": stats.prompt_tokens,
        "completion_tokens": stats.completion_tokens,
        "total_tokens": stats.prompt_tokens + stats.completion_tokens,
    }


@dataclass
class ResponseWriter:
    """Bodies of one response (one id, one creation time)."""

    api: ApiFormat
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    _text_offset: int = field(default=0, init=False)  # a streamed text completion's token texts so far

    def __post_init__(self) -> None:
        self.id = self.id or f"{self.api.id_prefix}{uuid.uuid4().hex}"

    def _envelope(self, name: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": name, "created": self.created, "model": self.model, "choices": choices}

    def whole(
        self,
        text: str,
        finish_reason: str,
        stats: Any,
        spec_prefill: dict[str, Any],
        tool_calls: Sequence[ToolCall] = (),
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> dict[str, Any]:
        body = self._envelope(self.api.object_name, [self.api.choice(text, finish_reason, tool_calls, logprobs)])
        return {**body, "usage": usage(stats), "spec_prefill": spec_prefill}

    def chunk(
        self,
        text: str,
        first: bool,
        finish_reason: str | None = None,
        spec_prefill: dict[str, Any] | None = None,
        tool_calls: Sequence[ToolCall] = (),
        call_index: int = 0,
        logprobs: Sequence[TokenLogprob] | None = None,
    ) -> dict[str, Any]:
        """One stream chunk; ``tool_calls``: the calls it completes, ``call_index``: how many came before;
        ``logprobs``: its tokens' (a text completion's ``text_offset`` continues from the chunks before).
        """
        choice = self.api.delta(text, finish_reason, first, tool_calls, call_index, logprobs, self._text_offset)
        self._text_offset += sum(len(entry.token) for entry in logprobs or ())
        body = self._envelope(self.api.chunk_name, [choice])
        return {**body, "spec_prefill": spec_prefill} if spec_prefill is not None else body

    def usage_chunk(self, stats: Any, spec_prefill: dict[str, Any]) -> dict[str, Any]:
        """The last chunk with ``stream_options.include_usage``: no choices, the usage and the stats."""
        return {**self._envelope(self.api.chunk_name, []), "usage": usage(stats), "spec_prefill": spec_prefill}


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event; ``"[DONE]"`` ends a stream."""
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"))
    return f"data: {data}\n\n".encode()
