"""What one request asks of the pipeline besides its prompt and decoding: one typed object, checked once at the
public boundary (engine methods, the gateway's ``spec_prefill`` object, the adapters) and passed inward whole.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any, Literal

from .arguments import check_flag, check_keep_rate, check_optional_flag, check_optional_text
from .errors import InvalidRequestError

KeepRate = float | Literal["auto"]


@dataclass(frozen=True)
class RequestOptions:
    """A request's SpecPrefill options; ``None`` takes the engine's (or gateway's) setting.

    Attributes:
        keep_rate: share of document tokens kept, in (0, 1], or ``"auto"``.
        max_document_tokens: cap on kept document tokens.
        reselect: score spans an earlier request compressed again (False: keep their tokens).
        draft_document_cache: take the documents' draft KV from the per-document cache.
        enabled: False sends the prompt whole, no draft.
        tenant: the namespace of the caches that outlive a request (draft prefix, document, main prefix caches
            and the selection memo): requests of one tenant never see what another's left there. None: the
            shared namespace of an engine used by one application.
    """

    keep_rate: KeepRate | None = None
    max_document_tokens: int | None = None
    reselect: bool | None = None
    draft_document_cache: bool | None = None
    enabled: bool = True
    tenant: str | None = None

    @classmethod
    def checked(cls, **options: Any) -> RequestOptions:
        """Options from a public caller's keywords, each checked (:class:`InvalidRequestError` names the bad one)."""
        cap = options.get("max_document_tokens")
        if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 0):
            raise InvalidRequestError(
                f"max_document_tokens must be a non-negative int or None, got {cap!r}; pass a token count"
            )
        return cls(
            keep_rate=check_keep_rate(options.get("keep_rate")),
            max_document_tokens=cap,
            reselect=check_optional_flag(options.get("reselect"), "reselect"),
            draft_document_cache=check_optional_flag(options.get("draft_document_cache"), "draft_document_cache"),
            enabled=check_flag(options.get("enabled", True), "enabled"),
            tenant=check_optional_text(options.get("tenant"), "tenant", "a cache namespace"),
        )

    def over(self, defaults: RequestOptions) -> RequestOptions:
        """These options, each unset one (None) taken from ``defaults``: a gateway's settings over the engine's,
        the engine's config under every request.
        """
        unset = {f.name: getattr(defaults, f.name) for f in fields(self) if getattr(self, f.name) is None}
        return replace(self, **unset)
