"""Typed errors. Every one names the problem and the fix.

All derive from :class:`SpecPrefillError`, so callers can catch either the precise kind or the
whole family. It is deliberately not a ``ValueError``: frameworks such as LlamaIndex's refine
synthesizer catch ``ValueError`` to retry structured output and would swallow a bad-request error.
Settings are validated by pydantic at construction and raise its ``ValidationError``.
"""

from __future__ import annotations


class SpecPrefillError(Exception):
    """Base class of every error this library raises on bad input or configuration."""


class InvalidRequestError(SpecPrefillError):
    """A request (question, documents, generation settings) is malformed."""


class OutputFormatError(InvalidRequestError):
    """An output format its grammar cannot serve: over a :class:`~specprefill_rag.config.GrammarLimits` bound
    (refused before compiling), or with a dead end (a part nothing can match, found while decoding).

    Attributes:
        tool: the name of the forced call's tool whose ``parameters`` are at fault, when one is.
        kind: the format's kind (``"json_schema"``, ``"tool_call"``...), when known.
    """

    def __init__(self, message: str, *, tool: str | None = None, kind: str | None = None) -> None:
        super().__init__(message)
        self.tool = tool
        self.kind = kind


class ContextLengthError(InvalidRequestError):
    """The prompt, or the prompt plus the tokens to generate, exceeds the main model's context."""

    def __init__(self, prompt_tokens: int, max_new_tokens: int, context_length: int, at_least: bool = False) -> None:
        """``at_least``: ``prompt_tokens`` is a lower bound (counting stopped once it passed the context)."""
        self.prompt_tokens = prompt_tokens
        self.max_new_tokens = max_new_tokens
        self.context_length = context_length
        self.at_least = at_least
        if prompt_tokens > context_length:
            count = f"at least {prompt_tokens}" if at_least else str(prompt_tokens)
            msg = (
                f"the prompt has {count} tokens but the main model's context is {context_length} tokens; "
                "retrieve fewer or shorter documents (nothing is truncated silently)"
            )
        else:
            msg = (
                f"prompt of {prompt_tokens} tokens + max_new_tokens={max_new_tokens} = "
                f"{prompt_tokens + max_new_tokens} exceeds the main model's context of {context_length} tokens; "
                f"lower max_new_tokens to at most {context_length - prompt_tokens} or shorten the prompt"
            )
        super().__init__(msg)


class DraftContextLengthError(InvalidRequestError):
    """The prompt, in the draft model's tokens and with its look-ahead, exceeds the draft's context."""

    def __init__(self, draft_tokens: int, look_ahead: int, context_length: int) -> None:
        self.draft_tokens = draft_tokens
        self.look_ahead = look_ahead
        self.context_length = context_length
        super().__init__(
            f"the prompt has {draft_tokens} tokens for the draft model (+{look_ahead - 1} look-ahead) but the draft's "
            f"context is {context_length} tokens; use a draft with a longer context or draft='self', retrieve fewer "
            "or shorter documents, or send this request with keep_rate=1.0 (no draft; nothing is truncated silently)"
        )


class ModelLoadError(SpecPrefillError):
    """A model spec could not be resolved or loaded."""


class TokenizerMismatchError(SpecPrefillError):
    """The draft and main models do not share a vocabulary, so token ids cannot be passed between them."""


class DraftScoringError(SpecPrefillError):
    """The draft model gave no usable token importance (no attention captured, or non-finite scores)."""


class DraftLimitError(InvalidRequestError):
    """The prompt is longer than the draft may read in one request (``max_draft_tokens``: draft memory)."""

    def __init__(self, prompt_tokens: int, max_draft_tokens: int) -> None:
        self.prompt_tokens = prompt_tokens
        self.max_draft_tokens = max_draft_tokens
        super().__init__(
            f"the prompt has {prompt_tokens} tokens but the draft may score at most {max_draft_tokens} per request "
            "(max_draft_tokens, which bounds the draft's memory); send fewer or shorter documents, raise "
            "max_draft_tokens, or pass keep_rate=1.0 to prefill the whole prompt without the draft"
        )


class DraftOutOfMemoryError(DraftScoringError):
    """The draft ran out of device memory scoring one prompt; the engine keeps serving other requests."""

    def __init__(self, prompt_tokens: int, device: str) -> None:
        self.prompt_tokens = prompt_tokens
        self.device = device
        super().__init__(
            f"the draft ran out of memory on {device} scoring a prompt of {prompt_tokens} tokens; lower "
            "max_draft_tokens below that (see the docs, 'Resource bounds'), send fewer documents, or give the draft "
            "a device with more free memory"
        )


# -- the servers this library talks to -------------------------------------------------------------


class VLLMServerError(SpecPrefillError):
    """The vLLM server is unreachable, lacks the plugin, or refused a request."""


class VLLMServerTimeout(VLLMServerError):
    """The vLLM server accepted the connection but did not answer (or went on answering) within the timeout."""


class GatewayClientError(SpecPrefillError):
    """The gateway is unreachable, failed (5xx), or answered something that is not an OpenAI stream."""
