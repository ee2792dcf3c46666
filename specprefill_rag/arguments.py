"""Request arguments, checked at the public boundary before a tokenizer or model sees them.

Every public request method (the engine's, the adapters', the CLI's) passes its arguments through
these checks, so a wrong type, text that is not valid Unicode, a blank value or a non-finite number
fails here with an :class:`~specprefill_rag.errors.InvalidRequestError` that names the argument and
the fix, not with a ``TypeError`` from inside the tokenizer. Nothing is coerced, truncated or dropped.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from pydantic import ValidationError

from .config import AUTO, MAX_TOP_LOGPROBS, GenerationParams
from .errors import InvalidRequestError

_REPR_LIMIT = 60


def shown(value: Any) -> str:
    """A short ``repr`` of a rejected value for an error message (the value itself is not changed)."""
    text = repr(value)
    return text if len(text) <= _REPR_LIMIT else f"{text[:_REPR_LIMIT]}... ({len(text)} characters)"


def check_unicode(value: str, name: str) -> str:
    r"""``value`` unchanged if it is valid Unicode; lone surrogates (``'\ud800'``: what decoding bytes
    with ``errors='surrogateescape'`` leaves) cannot be tokenized or sent as UTF-8.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as error:
        raise InvalidRequestError(
            f"{name} is not valid Unicode: character {error.start} is the lone surrogate {value[error.start]!r}; "
            "decode the source bytes with their real encoding (errors='replace' substitutes what cannot be decoded)"
        ) from None
    return value


def check_text(value: Any, name: str, what: str = "text") -> str:
    """A non-blank, valid-Unicode ``str``; ``what`` says in the message what belongs there."""
    if not isinstance(value, str):
        raise InvalidRequestError(
            f"{name} must be a str ({what}), got {type(value).__name__} {shown(value)}; pass the {what} as text"
        )
    if not value.strip():
        raise InvalidRequestError(f"{name} is empty or only whitespace; pass the {what}")
    return check_unicode(value, name)


def check_optional_text(value: Any, name: str, what: str = "text") -> str | None:
    """None, or :func:`check_text`: a blank value is refused rather than silently dropped (pass None)."""
    if value is None:
        return None
    if isinstance(value, str) and not value.strip():
        raise InvalidRequestError(f"{name} is empty or only whitespace; pass the {what}, or None for none")
    return check_text(value, name, what)


def check_flag(value: Any, name: str) -> bool:
    """A real ``bool`` (a string such as ``'no'`` would be true)."""
    if not isinstance(value, bool):
        raise InvalidRequestError(
            f"{name} must be True or False, got {type(value).__name__} {shown(value)}; pass a bool"
        )
    return value


def check_optional_flag(value: Any, name: str) -> bool | None:
    """None (the engine's setting) or a real ``bool``."""
    return None if value is None else check_flag(value, name)


def check_number(value: Any, name: str, fix: str) -> float:
    """A finite real number (int, float, NumPy scalars; not a bool, not a string)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidRequestError(f"{name} must be a number, got {type(value).__name__} {shown(value)}; {fix}")
    if not math.isfinite(value):
        raise InvalidRequestError(f"{name} must be finite, got {value}; {fix}")
    return float(value)


def check_keep_rate(value: Any) -> float | Literal["auto"] | None:
    """None (the engine's default), a number in (0, 1], or exactly ``"auto"`` (the engine chooses per request)."""
    if value is None:
        return None
    if isinstance(value, str) and value == AUTO:
        return AUTO
    fix = "pass a fraction of document tokens in (0, 1], e.g. keep_rate=0.3, 'auto', or None for the engine's setting"
    if isinstance(value, str):
        raise InvalidRequestError(f"keep_rate must be a number or 'auto', got str {shown(value)}; {fix}")
    rate = check_number(value, "keep_rate", fix)
    if not 0.0 < rate <= 1.0:
        raise InvalidRequestError(f"keep_rate must be in (0, 1], got {value}; {fix}")
    return rate


def check_documents(documents: Any) -> Sequence[Any]:
    """A list or tuple of documents (not one string, one mapping, a set or a one-shot iterator)."""
    if documents is None or (isinstance(documents, (list, tuple)) and not documents):
        raise InvalidRequestError(
            "no documents given; pass a list of retrieved documents, or use generate_text() for a plain prompt"
        )
    if isinstance(documents, (str, bytes, Mapping)) or not isinstance(documents, Sequence):
        raise InvalidRequestError(
            f"documents must be a list of documents (str, UTF-8 bytes, Document or a mapping with 'text'), got "
            f"{type(documents).__name__}; wrap a single document as [document], an iterator as list(...)"
        )
    return documents


def generation_params(fields: Mapping[str, Any], names: Mapping[str, str] | None = None) -> GenerationParams:
    """:class:`GenerationParams` from a request's keyword arguments; a bad value or an unknown option is
    an :class:`InvalidRequestError` naming it (a request is not configuration: pydantic's error is a
    ``ValueError``, which some frameworks catch and retry). ``names``: the caller's name for a field
    (e.g. ``{"max_new_tokens": "max_tokens"}``), used in the message.
    """
    try:
        return GenerationParams(**fields)
    except ValidationError as error:
        raise InvalidRequestError(_describe(error, names or {})) from None


_EXPECTED = {
    "max_new_tokens": "an int >= 1, e.g. max_new_tokens=128",
    "temperature": "a finite number >= 0 (0 = greedy), e.g. temperature=0.7",
    "top_p": "a number in (0, 1], e.g. top_p=0.9",
    "seed": "an int in [0, 2**63), or None",
    "stop": "a non-empty string or a list of them",
    "logprobs": "True or False, e.g. logprobs=True",
    "top_logprobs": f"an int in [0, {MAX_TOP_LOGPROBS}] together with logprobs=True, e.g. top_logprobs=5",
}


def _describe(error: ValidationError, names: Mapping[str, str]) -> str:
    known = ", ".join(names.get(field, field) for field in GenerationParams.model_fields)
    problems = []
    for item in error.errors():
        field = ".".join(str(part) for part in item["loc"][:1])
        name = names.get(field, field)
        if item["type"] == "extra_forbidden":
            problems.append(f"unknown option {name!r}; use one of the generation options: {known}")
            continue
        problem = item["msg"].removeprefix("Value error, ").rstrip(".")
        expected = _EXPECTED.get(field, "a valid value").replace(field, name)
        problems.append(f"{name}: {problem} (got {shown(item['input'])}); pass {expected}")
    return "; ".join(problems)


def check_params(params: Any) -> GenerationParams | None:
    """None or a :class:`GenerationParams` (for the ``*_layout`` methods)."""
    if params is not None and not isinstance(params, GenerationParams):
        raise InvalidRequestError(
            f"params must be a GenerationParams or None, got {type(params).__name__}; "
            "build it as GenerationParams(max_new_tokens=..., ...)"
        )
    return params
