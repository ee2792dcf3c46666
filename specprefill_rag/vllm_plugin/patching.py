"""The one way this plugin wraps a vLLM method: idempotent, the original kept on the class, removable."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any


def wrap_method(
    owner: type, name: str, marker: str, make_wrapper: Callable[[Callable[..., Any]], Callable[..., Any]]
) -> None:
    """Replace ``owner.name`` with ``make_wrapper(original)``; the original is kept as ``owner.marker``."""
    if marker in owner.__dict__:
        return
    original = getattr(owner, name)
    setattr(owner, marker, original)
    setattr(owner, name, make_wrapper(original))


def restore_method(owner: type, name: str, marker: str) -> None:
    """Put back the original that :func:`wrap_method` kept (no-op when not wrapped)."""
    original = owner.__dict__.get(marker)
    if original is not None:
        setattr(owner, name, original)
        delattr(owner, marker)


def is_wrapped(owner: type, marker: str) -> bool:
    return marker in owner.__dict__
