"""What travels between the client and a vLLM server: stream events and the errors they map to.

Shared by the blocking (urllib) and the async (httpx) client. A stream ends with ``data: [DONE]`` or an
end-of-sequence token; one that stops before (the server was killed or restarted) is an error, never
a shorter answer. Events that are not vLLM's, and reads that fail, are :class:`VLLMServerError`;
refusals (HTTP 4xx, or an ``error`` event) are :class:`InvalidRequestError`. With
``stream_options.include_usage`` the last event before ``[DONE]`` has no choices and the request's
``usage``; its ``prompt_tokens_details.cached_tokens`` (a server started with
``--enable-prompt-tokens-details``) are the prompt tokens vLLM's prefix cache served.
"""

from __future__ import annotations

import json
import urllib.parse
from typing import Any, Literal, NamedTuple

import httpx

from ..arguments import check_text
from ..errors import InvalidRequestError, SpecPrefillError, VLLMServerError, VLLMServerTimeout
from ..results import PrefillReport, StepLogprobs

# VLLMServerError and VLLMServerTimeout live in errors.py; imported above, they still import from here (their old home).


def _is_timeout(error: BaseException) -> bool:
    reason = getattr(error, "reason", None)  # urllib wraps a socket timeout in URLError.reason
    return isinstance(error, (TimeoutError, httpx.TimeoutException)) or isinstance(reason, TimeoutError)


def _kind(error: BaseException) -> type[VLLMServerError]:
    return VLLMServerTimeout if _is_timeout(error) else VLLMServerError


class StreamEvent(NamedTuple):
    """One server-sent-events line: its token ids, up to the first end-of-sequence id, and ``end``:
    ``"eos"`` (stop reading), ``"done"`` (``data: [DONE]``: the stream is complete) or None; ``logprobs``:
    those tokens' log-probabilities when the event carries them (else empty).
    """

    tokens: list[int]
    end: Literal["eos", "done"] | None = None
    logprobs: tuple[StepLogprobs, ...] = ()


def sse_tokens(
    line: str | bytes, eos_ids: frozenset[int], report: PrefillReport | None = None, top_logprobs: int = 0
) -> StreamEvent:
    """The tokens of one server-sent-events line of a streamed completion.

    A streamed request that vLLM refuses still gets status 200; the refusal comes as an ``error``
    event, raised here as for a non-streamed one (4xx: :class:`InvalidRequestError`). An event that is
    not vLLM's is a :class:`VLLMServerError`. The usage event (no choices) has no tokens; when it
    counts cached prompt tokens, they go to ``report.cached_tokens``. A request sent with ``logprobs``
    and ``return_tokens_as_token_ids`` gets the completions API's legacy ``logprobs`` (tokens as
    ``"token_id:<id>"``): read into :class:`StepLogprobs` with the ``top_logprobs`` most likely.
    """
    try:
        text = (line.decode() if isinstance(line, bytes) else line).strip()
    except UnicodeDecodeError:
        raise malformed(line, "not UTF-8") from None
    if text == "data: [DONE]":
        return StreamEvent([], "done")
    if not text.startswith("data:"):
        return StreamEvent([])
    try:
        event = json.loads(text[len("data:") :])
        if "error" in event:
            error = event["error"]
            code = error.get("code") if isinstance(error, dict) else None
            raise refused(code if isinstance(code, int) else 500, json.dumps(event))
        usage = event.get("usage")
        choices = event["choices"] if usage is None or "choices" in event else []
        ids = [choice.get("token_ids") or [] for choice in choices]
        steps = [step for choice in choices for step in _wire_logprobs(choice.get("logprobs"), top_logprobs)]
        if usage is not None and report is not None:
            report.cached_tokens = _cached_tokens(usage, report.cached_tokens)
    except (ValueError, KeyError, TypeError, AttributeError) as error:
        raise malformed(text, f"{type(error).__name__}: {error}") from None
    tokens: list[int] = []
    for token in (token for choice in ids for token in choice):
        if not isinstance(token, int) or isinstance(token, bool):
            raise malformed(text, f"token id {token!r} is not an int")
        if steps and (len(steps) <= len(tokens) or steps[len(tokens)].token_id != token):
            raise malformed(text, f"its log-probabilities do not follow its token ids at token {token}")
        if token in eos_ids:
            return StreamEvent(tokens, "eos", tuple(steps[: len(tokens)]))
        tokens.append(token)
    return StreamEvent(tokens, None, tuple(steps))


_TOKEN_ID = "token_id:"  # how vLLM writes a token with return_tokens_as_token_ids


def _token_id(token: str) -> int:
    if not token.startswith(_TOKEN_ID):
        raise ValueError(f"token {token[:40]!r} is not written as 'token_id:<id>' (return_tokens_as_token_ids)")
    return int(token[len(_TOKEN_ID) :])


def _wire_logprobs(block: dict[str, Any] | None, top: int) -> list[StepLogprobs]:
    """A choice's legacy ``logprobs`` (``tokens``, ``token_logprobs``, ``top_logprobs``) as steps; none without."""
    if block is None:
        return []
    steps = []
    for token, candidates in zip(block["tokens"], block["top_logprobs"], strict=True):
        scores = {_token_id(key): float(value) for key, value in candidates.items()}
        steps.append(StepLogprobs.from_candidates(_token_id(token), scores, top))
    return steps


def _cached_tokens(usage: dict[str, object], known: int | None) -> int | None:
    """``usage.prompt_tokens_details.cached_tokens`` when the server sent it, else ``known``."""
    details = usage.get("prompt_tokens_details") if isinstance(usage, dict) else None
    cached = details.get("cached_tokens") if isinstance(details, dict) else None
    return cached if isinstance(cached, int) and not isinstance(cached, bool) and cached >= 0 else known


def malformed(event: str | bytes, problem: str) -> VLLMServerError:
    shown = repr(event) if len(event) <= 120 else f"{event[:120]!r}..."
    return VLLMServerError(
        f"the server sent a stream event that is not vLLM's ({problem}): {shown}; check that the URL is a vLLM "
        "OpenAI-compatible server"
    )


def interrupted(base_url: str, timeout: float, received: int, error: BaseException) -> VLLMServerError:
    """A read failed after the server had answered: it stopped, dropped the connection or went silent."""
    return _kind(error)(
        f"the vLLM server at {base_url} failed mid-stream after {received} tokens ({error or type(error).__name__}; "
        f"reads time out after {timeout:g} s); the answer is incomplete: check that the server is running and retry"
    )


def cut_short(base_url: str, received: int) -> VLLMServerError:
    """The stream ended without ``[DONE]`` or end-of-sequence: the server stopped or dropped the connection."""
    return VLLMServerError(
        f"the vLLM server at {base_url} closed the stream after {received} tokens, before it ended (was it stopped "
        "or restarted?); the answer is incomplete, so retry the request"
    )


def refused(code: int, detail: str) -> SpecPrefillError:
    """The error for an HTTP error status: the request's fault (4xx) or the server's."""
    if 400 <= code < 500:
        return InvalidRequestError(
            f"the vLLM server refused the request ({code}): {detail}; change the request as it says"
        )
    return VLLMServerError(f"the vLLM server failed ({code}): {detail}; check the server's log")


def unreachable(base_url: str, timeout: float, error: BaseException) -> VLLMServerError:
    """Connecting failed, or the server sent nothing within the timeout (:class:`VLLMServerTimeout`)."""
    return _kind(error)(
        f"cannot reach a vLLM server at {base_url} within {timeout:g} s ({error or type(error).__name__}); "
        "check the URL and that the server is running"
    )


def check_server_url(url: str) -> None:
    """An ``http(s)://host[:port]`` URL, checked before anything is sent."""
    try:
        parts = urllib.parse.urlsplit(check_text(url, "server", "vLLM server URL"))
        valid = parts.scheme in ("http", "https") and bool(parts.hostname) and parts.port != 0
    except ValueError:  # e.g. a port that is not a number
        valid = False
    if not valid or any(c.isspace() for c in url):
        raise InvalidRequestError(f"server {url!r} is not an http(s) URL; pass e.g. 'http://127.0.0.1:8000'")
