"""What goes wrong in the gateway, as HTTP answers: status, OpenAI error type, the field at fault.

Every failure of one request becomes a :class:`GatewayError` (:func:`as_gateway_error`); the gateway
answers it with vLLM's error body and goes on serving the other requests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..backends.vllm import VLLMServerError, VLLMServerTimeout
from ..errors import ContextLengthError, InvalidRequestError, SpecPrefillError

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


def as_gateway_error(error: BaseException, main_is_remote: bool) -> GatewayError:
    """The HTTP answer to an exception raised while serving one request."""
    if isinstance(error, GatewayError):
        return error
    if isinstance(error, VLLMServerTimeout):
        return GatewayError(504, f"the main model server timed out: {error}", "GatewayTimeoutError", "timeout")
    if isinstance(error, VLLMServerError):
        return GatewayError(502, f"the main model server failed: {error}", "BadGatewayError", "upstream_error")
    if isinstance(error, ContextLengthError):
        too_long = error.prompt_tokens > error.context_length
        return bad_request(str(error), "messages" if too_long else "max_tokens")
    if isinstance(error, InvalidRequestError):
        return bad_request(str(error))
    if main_is_remote and not isinstance(error, SpecPrefillError):
        message = f"the main model server answered something the gateway cannot read ({type(error).__name__}: {error})"
        return GatewayError(502, message, "BadGatewayError", "upstream_error")
    return GatewayError(500, f"internal error ({type(error).__name__}: {error})", "InternalServerError", "error")
