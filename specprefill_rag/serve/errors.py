"""What goes wrong in the gateway, as HTTP answers: status, OpenAI error type, the field at fault.

Every failure of one request becomes a :class:`GatewayError` (:func:`as_gateway_error`); the gateway
answers it with vLLM's error body and goes on serving the other requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..backends.vllm import VLLMServerError, VLLMServerTimeout
from ..errors import (
    ContextLengthError,
    DraftContextLengthError,
    DraftLimitError,
    InvalidRequestError,
    OutputFormatError,
    SpecPrefillError,
)

OUTCOMES = (
    "ok",
    "bad_request",
    "unauthorized",
    "not_found",
    "queue_full",
    "draft_failed",
    "upstream_error",
    "timeout",
    "disconnected",
    "error",
    "too_large",
    "client_timeout",
    "overloaded",
)
# Longest piece of a client's value an error message repeats (a 1 MB model name is not echoed back whole).
_ECHO_LIMIT = 80


class ClientGone(Exception):
    """The client closed the connection; nothing more is sent."""


def echoed(value: str) -> str:
    """``value`` for an error message: cut to ``_ECHO_LIMIT`` characters, saying how long it was."""
    return value if len(value) <= _ECHO_LIMIT else f"{value[:_ECHO_LIMIT]}... ({len(value)} characters)"


@dataclass
class GatewayError(Exception):
    """One request's failure as the gateway answers it.

    Attributes:
        status: HTTP status.
        message: what went wrong and what to do.
        kind: OpenAI error ``type`` (``BadRequestError``...).
        outcome: the ``outcome`` label of ``specprefill_requests_total``.
        param: the request field at fault, if one is.
        headers: extra response headers (``Retry-After``).
    """

    status: int
    message: str
    kind: str
    outcome: str
    param: str | None = None
    headers: dict[str, str] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.message

    def body(self) -> dict[str, object]:
        """vLLM's error body: the ``openai`` client raises its status error with this message."""
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.status}}


def bad_request(message: str, param: str | None = None) -> GatewayError:
    return GatewayError(400, message, "BadRequestError", "bad_request", param)


def unauthorized() -> GatewayError:
    return GatewayError(
        401, "missing or wrong API key; send 'Authorization: Bearer <key>'", "AuthenticationError", "unauthorized"
    )


def too_large(limit: int) -> GatewayError:
    message = (
        f"the request body is over the gateway's limit of {limit} bytes; send fewer or shorter documents, or "
        "raise --max-body-bytes"
    )
    return GatewayError(413, message, "RequestTooLargeError", "too_large", headers={"Connection": "close"})


def body_too_slow(seconds: float) -> GatewayError:
    message = f"the request body did not arrive within {seconds:g} s; send it at once, or raise --body-timeout"
    return GatewayError(408, message, "RequestTimeoutError", "client_timeout", headers={"Connection": "close"})


def not_json(content_type: str) -> GatewayError:
    message = f"POST bodies must be JSON sent with 'Content-Type: application/json', got {echoed(content_type)!r}"
    return GatewayError(415, message, "UnsupportedMediaTypeError", "bad_request", headers={"Connection": "close"})


def overloaded(in_flight: int, retry_after_s: int) -> GatewayError:
    message = f"the gateway is serving its limit of {in_flight} requests at once; retry after {retry_after_s} s"
    return GatewayError(429, message, "RateLimitError", "overloaded", headers={"Retry-After": str(retry_after_s)})


def key_overloaded(per_key: int, retry_after_s: int) -> GatewayError:
    message = (
        f"this API key already has its limit of {per_key} requests in flight (max_requests_per_key); retry after "
        f"{retry_after_s} s, or send fewer at once"
    )
    return GatewayError(429, message, "RateLimitError", "overloaded", headers={"Retry-After": str(retry_after_s)})


def workers_busy(work: str, threads: int, queue: int, setting: str, retry_after_s: int = 1) -> GatewayError:
    """503: the bounded workers of one kind of heavy work (grammar compiles, warm-ups) are all taken."""
    message = (
        f"the gateway's {work} workers are busy ({threads} running, {queue} waiting); retry after {retry_after_s} s, "
        f"or raise {setting}"
    )
    headers = {"Retry-After": str(retry_after_s)}
    return GatewayError(503, message, "ServiceUnavailableError", "overloaded", headers=headers)


def too_many_bodies(limit: int, scope: str) -> GatewayError:
    message = (
        f"the gateway is already receiving its limit of {limit} request bodies {scope}; send each body at once "
        "and retry after 1 s"
    )
    return GatewayError(
        429, message, "RateLimitError", "overloaded", headers={"Retry-After": "1", "Connection": "close"}
    )


def queue_full(depth: int, retry_after_s: int) -> GatewayError:
    message = f"the draft queue is full ({depth} requests waiting); retry after {retry_after_s} s"
    return GatewayError(429, message, "RateLimitError", "queue_full", headers={"Retry-After": str(retry_after_s)})


def deadline_exceeded(seconds: float, phase: str) -> GatewayError:
    message = f"the request's deadline of {seconds:g} s passed while {phase}; raise --request-timeout or retry"
    return GatewayError(504, message, "GatewayTimeoutError", "timeout")


def draft_failed(error: BaseException) -> GatewayError:
    message = (
        f"the draft model failed on this request ({type(error).__name__}: {error}); the gateway runs with "
        "--on-draft-error fail, so nothing was sent to the main model"
    )
    return GatewayError(500, message, "DraftScoringError", "draft_failed")


@dataclass(frozen=True)
class WireNames:
    """A request's field names, for errors that name a field: ``tokens``, the one that set the answer's token
    limit (``max_tokens`` or ``max_completion_tokens``, whichever the client sent); ``prompt``, the prompt's
    (``messages`` or ``prompt``).
    """

    tokens: str = "max_tokens"
    prompt: str = "messages"


def _context_error(error: ContextLengthError, names: WireNames) -> GatewayError:
    """A prompt past the main model's context, in the wire's words (the library's name Python arguments)."""
    prompt, context = error.prompt_tokens, error.context_length
    if prompt > context:
        count = f"at least {prompt}" if error.at_least else str(prompt)
        message = (
            f"the prompt has {count} tokens but the main model's context is {context} tokens; send fewer or "
            f"shorter {names.prompt}, documents or tools (nothing is truncated silently)"
        )
        return bad_request(message, names.prompt)
    field, total = names.tokens, prompt + error.max_new_tokens
    message = (
        f"the prompt of {prompt} tokens + {field} {error.max_new_tokens} = {total} exceeds the main model's "
        f"context of {context} tokens; lower {field} to at most {context - prompt}, or shorten the prompt"
    )
    return bad_request(message, field)


def _draft_context_error(error: DraftContextLengthError, names: WireNames) -> GatewayError:
    message = (
        f"the prompt has {error.draft_tokens} tokens for the draft model (+{error.look_ahead - 1} look-ahead) but "
        f"the draft's context is {error.context_length} tokens; send fewer or shorter documents, or send "
        '"spec_prefill": {"keep_rate": 1.0} (no draft; nothing is truncated silently), or start the gateway '
        "with a draft of a longer context (--draft)"
    )
    return bad_request(message, names.prompt)


def _draft_limit_error(error: DraftLimitError, names: WireNames) -> GatewayError:
    message = (
        f"the prompt has {error.prompt_tokens} tokens but the draft may score at most {error.max_draft_tokens} "
        "per request (--max-draft-tokens, which bounds the draft's memory); send fewer or shorter documents, or "
        'send "spec_prefill": {"keep_rate": 1.0} to prefill the whole prompt without the draft'
    )
    return bad_request(message, names.prompt)


def as_gateway_error(error: BaseException, main_is_remote: bool, names: WireNames = WireNames()) -> GatewayError:
    """The HTTP answer to an exception raised while serving one request; ``names``: the request's field names,
    so a message speaks the wire's (``max_completion_tokens``, ``spec_prefill.keep_rate``), not Python's.
    """
    if isinstance(error, GatewayError):
        return error
    if isinstance(error, VLLMServerTimeout):
        return GatewayError(504, f"the main model server timed out: {error}", "GatewayTimeoutError", "timeout")
    if isinstance(error, VLLMServerError):
        return GatewayError(502, f"the main model server failed: {error}", "BadGatewayError", "upstream_error")
    if isinstance(error, ContextLengthError):
        return _context_error(error, names)
    if isinstance(error, DraftContextLengthError):
        return _draft_context_error(error, names)
    if isinstance(error, DraftLimitError):
        return _draft_limit_error(error, names)
    if isinstance(error, OutputFormatError):  # a dead end found while decoding: the format's own field
        return bad_request(str(error), "tools" if error.kind == "tool_call" else "response_format")
    if isinstance(error, InvalidRequestError):
        return bad_request(str(error))
    if main_is_remote and not isinstance(error, SpecPrefillError):
        message = f"the main model server answered something the gateway cannot read ({type(error).__name__}: {error})"
        return GatewayError(502, message, "BadGatewayError", "upstream_error")
    return GatewayError(500, f"internal error ({type(error).__name__}: {error})", "InternalServerError", "error")
