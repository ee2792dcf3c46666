"""Request bodies of the gateway's OpenAI API, with vLLM's OpenAI server's field names.

Only fields the gateway honours are declared; any other field is refused (``extra="forbid"``) with a
400 that names it, and so is a declared field whose value asks for something unsupported (``n=2``,
``logprobs``, a penalty): nothing a client asks for is silently ignored. Types are strict: ``true`` is
not a number, ``"yes"`` not a boolean, ``1.0`` not an integer (an integer is a number). Integers have
bounds, so a 4,000-digit ``max_tokens`` fails here, before any work. The per-request SpecPrefill
options travel in ``spec_prefill`` (OpenAI clients send it with ``extra_body``).
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from ..config import MIN_TEMPERATURE, StrictKeepRate, check_temperature
from ..prompt.context import SystemContext
from .errors import echoed

MAX_TOKENS = (1 << 31) - 1  # bound of every token count a request names (contexts are far smaller)
MAX_STOP_STRINGS = 32  # each generated token is checked against every stop string


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class DocumentOption(_Strict):
    """A retrieved document: its text, and optionally a title (shown to the model) and an id."""

    text: str
    title: str | None = None
    id: str | None = None


class SpecPrefillOptions(_Strict):
    """Per-request SpecPrefill settings; absent fields take the gateway's defaults."""

    enabled: bool = Field(True, description="False: send the whole prompt, no draft.")
    keep_rate: StrictKeepRate | None = Field(
        None,
        description="Share of document tokens kept, in (0, 1], or 'auto' (chosen per request from the draft's "
        "importance).",
    )
    max_document_tokens: int | None = Field(None, ge=0, le=MAX_TOKENS, description="Cap on kept document tokens.")
    documents: list[str | DocumentOption] | None = Field(
        None,
        min_length=1,
        description="The retrieved documents: located verbatim in the messages, else inserted before the last user "
        "message's text. Without them, documents come from document content parts or the fallback rule.",
    )
    question: str | None = Field(None, description="The question when it is not simply the last user message.")
    insert_documents: bool = Field(
        True,
        description="False: documents not all found verbatim in the messages are not inserted; the fallback "
        "rule applies instead.",
    )
    system_context: SystemContext | None = Field(
        None,
        description="Retrieved context sent as plain text in a system message (framework RAG templates): 'off', "
        "'delimited' (the context spans of known templates are documents) or 'after_instructions' (after a "
        "'Context:' label or the first paragraph, all is documents); the instructions stay whole. None: the "
        "gateway's --system-context. Explicit documents (documents, document parts) win.",
    )


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class DocumentPart(_Strict):
    """A retrieved document as a content part: only its tokens may be dropped."""

    type: Literal["document"]
    text: str
    title: str | None = None
    id: str | None = None


ContentPart = Annotated[TextPart | DocumentPart, Field(discriminator="type")]


_TOOLS_NOT_YET = (
    "tool calling is not supported by the SpecPrefill gateway yet (no tools, tool calls or tool results; "
    "issue #30): send the retrieved documents in spec_prefill.documents or as document content parts"
)


class Message(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[ContentPart]

    @model_validator(mode="before")
    @classmethod
    def _no_tool_history(cls, value: Any) -> Any:
        """An agent's history (a tool result, an assistant's tool calls) gets the real cause, not a field error."""
        if isinstance(value, dict) and (
            value.get("role") in ("tool", "function") or "tool_calls" in value or "function_call" in value
        ):
            raise ValueError(_TOOLS_NOT_YET)
        return value


class StreamOptions(_Strict):
    include_usage: bool = False


def _neutral(name: str, value: Any, neutral: tuple[Any, ...], why: str) -> Any:
    if value not in neutral:
        raise ValueError(f"{name}={echoed(repr(value))} is not supported by the SpecPrefill gateway ({why})")
    return value


class _Sampling(_Strict):
    """Fields common to chat and text completions."""

    model: str
    temperature: float = Field(1.0, ge=0.0, description=f"0 = greedy; else at least {MIN_TEMPERATURE}.")
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    seed: int | None = Field(None, ge=0, lt=2**63)
    stop: str | Annotated[list[str], Field(max_length=MAX_STOP_STRINGS)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: int = 1
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    spec_prefill: SpecPrefillOptions = Field(default_factory=SpecPrefillOptions)

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        return check_temperature(value)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        return _neutral("n", value, (1,), "one choice per request")

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalty(cls, value: float, info: Any) -> float:
        return _neutral(info.field_name, value, (0, 0.0), "no sampling penalties")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool | None = None
    # Accepted only with the values that ask for nothing (clients send them by default); see _TOOLS_NOT_YET.
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    response_format: Any = None

    @field_validator("logprobs")
    @classmethod
    def _no_logprobs(cls, value: bool | None) -> bool | None:
        return _neutral("logprobs", value, (None, False), "no log-probabilities")

    @field_validator("tools", "tool_choice")
    @classmethod
    def _no_tools(cls, value: Any, info: Any) -> Any:
        if value in (None, [], "none"):
            return value
        raise ValueError(f"{info.field_name}: {_TOOLS_NOT_YET}")

    @field_validator("response_format")
    @classmethod
    def _text_only(cls, value: Any) -> Any:
        if value is None or value == {"type": "text"}:
            return value
        raise ValueError(
            f"response_format={echoed(repr(value))} is not supported by the SpecPrefill gateway yet (structured "
            "output: issue #30); leave it out or send {'type': 'text'}"
        )

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a text prompt (a list of one prompt is accepted)."""

    prompt: str | list[str]
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS)
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError(f"a list of {len(value)} prompts is not supported; send one prompt per request")
        return value

    @field_validator("echo", "logprobs", "suffix")
    @classmethod
    def _unsupported(cls, value: Any, info: Any) -> Any:
        return _neutral(info.field_name, value, (None, False), "not implemented")

    @property
    def text(self) -> str:
        return self.prompt[0] if isinstance(self.prompt, list) else self.prompt

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's fields): the prompt's token ids as the main model reads them."""

    model: str | None = None
    prompt: str
    add_special_tokens: bool = False


def _is_branch_label(part: object) -> bool:
    """pydantic names the union member it tried in an error's location (``str``, ``list[...]``...)."""
    text = str(part)
    return (
        text in ("str", "int", "float", "bool", "none")
        or "[" in text
        or text.startswith("function-")
        or text[:1].isupper()
    )


def first_problem(error: ValidationError) -> tuple[str, str]:
    """The most specific validation problem as (field path, message), e.g. ``("spec_prefill.keep_rate", ...)``.

    A value no member of a union accepts fails once per member; the deepest failure says the most, and of
    equally deep ones a broken constraint (a list too long) more than a member whose type did not match.
    """
    problem = max(error.errors(), key=lambda e: (len(e["loc"]), not e["type"].endswith("_type")))
    field = ".".join(str(part) for part in problem["loc"] if not _is_branch_label(part)) or "body"
    if problem["type"] == "extra_forbidden":
        return field, f"unsupported field '{field}': the SpecPrefill gateway does not support it; remove it"
    if problem["type"] == "missing":
        return field, f"field '{field}' is required"
    message = problem["msg"].removeprefix("Value error, ")
    return field, f"invalid '{field}': {message}"
