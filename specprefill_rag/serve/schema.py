"""Request bodies of the gateway's OpenAI API, with vLLM's OpenAI server's field names.

Only fields the gateway honours are declared; any other field is refused (``extra="forbid"``) with a
400 that names it, and so is a declared field whose value asks for something unsupported (``n=2``,
``echo``): nothing a client asks for is silently ignored. Types are strict: ``true`` is
not a number, ``"yes"`` not a boolean, ``1.0`` not an integer (an integer is a number). Integers have
bounds, so a 4,000-digit ``max_tokens`` fails here, before any work. The per-request SpecPrefill
options travel in ``spec_prefill`` (OpenAI clients send it with ``extra_body``).

Tool calling takes OpenAI's fields: ``tools``, ``tool_choice``, ``parallel_tool_calls``, assistant messages
with ``tool_calls`` (arguments as a JSON object encoded as a string) and ``tool`` messages answering them by
``tool_call_id``; ``response_format`` asks for JSON (``json_object``, ``json_schema``). Legacy function
calling (``functions``, ``function_call``, role ``function``) is refused with the modern fields' names.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import pydantic_core
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from ..config import (
    MAX_PENALTY,
    MAX_TOP_LOGPROBS,
    MAX_WARM_DOCUMENTS,
    MIN_TEMPERATURE,
    OutputFormat,
    StrictKeepRate,
    SystemContext,
    check_temperature,
)
from ..errors import InvalidRequestError
from ..prompt.tools import (
    MAX_ARGUMENTS_DEPTH,
    TOOL_NAME,
    ToolChoice,
    check_depth,
    check_tool_choice,
    check_tool_count,
    check_tools,
)
from ..results import ToolCall
from .errors import WireNames, echoed

MAX_TOKENS = (1 << 31) - 1  # bound of every token count a request names (contexts are far smaller)
MAX_STOP_STRINGS = 32  # each generated token is checked against every stop string
MAX_LEGACY_LOGPROBS = 5  # OpenAI's bound of /v1/completions' integer logprobs


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class DocumentOption(_Strict):
    """A retrieved document: its text, and optionally a title (shown to the model) and an id."""

    text: str
    title: str | None = None
    id: str | None = None

    @field_validator("title")
    @classmethod
    def _title_not_blank(cls, value: str | None) -> str | None:
        """In the wire's words (the core's message speaks to Python callers)."""
        if value is not None and not value.strip():
            raise ValueError("is empty or only whitespace; send a title, or null for none")
        return value


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
    compress_tool_results: bool = Field(
        True, description="False: every tool result ('tool' message) stays whole; by default each is a document."
    )
    reselect: bool | None = Field(
        None,
        description="False (stable selection): a document or tool result compressed by an earlier request of the "
        "conversation keeps the tokens chosen then, so the main model's prefix cache serves the history; True: "
        "score every span again against this question. None: the gateway's --reselect (default true).",
    )
    keep_tools_whole: list[str] = Field(
        default_factory=list,
        description="Names of tools whose results stay whole (the others' results are documents); each must be "
        "offered in tools or called in the messages.",
    )
    draft_document_cache: bool | None = Field(
        None,
        description="True: the draft takes each document's KV from the per-document cache (drafted once, moved to "
        "where the document sits; an approximation, docs: Document cache); False: the documents are drafted "
        "together. None: the gateway's --draft-document-cache (default false). True needs --document-cache-mb "
        "above 0.",
    )

    @field_validator("question")
    @classmethod
    def _question_not_blank(cls, value: str | None) -> str | None:
        """In the wire's words (the core's message speaks to Python callers)."""
        if value is not None and not value.strip():
            raise ValueError("is empty or only whitespace; send the user's question, or null for the last user message")
        return value


class WarmDocumentsRequest(_Strict):
    """``POST /v1/spec_prefill/documents/warm``: documents drafted into the per-document cache ahead of the
    requests that hold them (at ingestion), after the prefix the ``instructions`` (a system message) render.
    """

    documents: list[str | DocumentOption] = Field(
        min_length=1,
        description=f"The documents, at most {MAX_WARM_DOCUMENTS} per call (send a corpus in several calls).",
    )
    instructions: str | None = Field(
        None,
        description="The system message of the requests that will hold these documents: the cache is keyed by "
        "the prompt's prefix, so documents warmed with other instructions (or none) are not found.",
    )

    @field_validator("documents", mode="before")
    @classmethod
    def _bounded(cls, value: Any) -> Any:
        if isinstance(value, list) and len(value) > MAX_WARM_DOCUMENTS:
            raise ValueError(
                f"{len(value)} documents in one call; send at most {MAX_WARM_DOCUMENTS} per call (split the corpus "
                "into several calls)"
            )
        return value

    @field_validator("instructions")
    @classmethod
    def _not_blank(cls, value: str | None) -> str | None:
        if value is not None and not value.strip():
            raise ValueError("is empty or only whitespace; send the system message of later requests, or null")
        return value


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

_LEGACY_FUNCTIONS = (
    "legacy function calling is not supported by the SpecPrefill gateway; use the modern fields: tools and "
    "tool_choice in the request, tool_calls in assistant messages, role 'tool' with tool_call_id for results"
)


def _check_tool_name(value: str) -> str:
    """OpenAI's rule for function names (plus dots), as :func:`~specprefill_rag.prompt.tools.check_tools` applies."""
    if not TOOL_NAME.fullmatch(value):
        raise ValueError(f"a tool name is 1-64 letters, digits, '_', '-' or '.', got {echoed(repr(value))}")
    return value


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def json_object(text: str) -> dict[str, Any]:
    """``text`` decoded as a JSON object nested at most :data:`MAX_ARGUMENTS_DEPTH` deep (NaN and Infinity are
    not JSON); ValueError otherwise. Decoded by jiter, which bounds nesting itself (Python's ``json`` would
    recurse until a ``RecursionError``); its other errors are told in Python's ``json`` words.
    """
    try:
        value = pydantic_core.from_json(text, allow_inf_nan=False)
    except ValueError as error:
        if "recursion limit" in str(error):
            raise ValueError(
                f"must be a JSON object encoded as a string, nested at most {MAX_ARGUMENTS_DEPTH} deep ({error})"
            ) from None
        try:  # bounded: jiter found no nesting past its limit
            json.loads(text, parse_constant=_no_constant)
        except ValueError as described:
            error = described
        raise ValueError(f"must be a JSON object encoded as a string ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"must be a JSON object encoded as a string, got a JSON {type(value).__name__}")
    try:
        check_depth(value, "arguments")
    except InvalidRequestError as error:
        raise ValueError(str(error)) from None
    return value


class CalledFunction(_Strict):
    """The function of a history's tool call; ``arguments`` is a JSON object encoded as a string (OpenAI's shape)."""

    name: str
    arguments: str

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _check_tool_name(value)

    @field_validator("arguments")
    @classmethod
    def _object(cls, value: str) -> str:
        json_object(value)
        return value


class ToolCallOption(_Strict):
    """A tool call an earlier assistant message made."""

    id: str = Field(min_length=1)
    type: Literal["function"]
    function: CalledFunction

    @property
    def core(self) -> ToolCall:
        """The call as the core reads it (arguments decoded)."""
        return ToolCall(self.function.name, json_object(self.function.arguments), self.id)


def _role(info: ValidationInfo) -> str | None:
    """The message's role, None when it did not validate (that error is reported instead)."""
    role = info.data.get("role")
    return role if isinstance(role, str) else None


class Message(_Strict):
    """An OpenAI chat message. Tool messages answer a call of an earlier assistant message (``tool_call_id``);
    their content is text (a document by default: see ``spec_prefill.compress_tool_results``). Fields are
    validated in the order declared, so each validator sees the role (and the calls) before it.
    """

    role: Literal["system", "developer", "user", "assistant", "tool"]
    tool_calls: list[ToolCallOption] | None = None
    tool_call_id: str | None = Field(None, validate_default=True)
    name: str | None = None
    content: str | list[ContentPart] | None = Field(None, validate_default=True)

    @model_validator(mode="before")
    @classmethod
    def _no_legacy_functions(cls, value: Any) -> Any:
        """Legacy function calling (role 'function', ``function_call``) gets the modern fields' names."""
        if isinstance(value, dict) and (value.get("role") == "function" or "function_call" in value):
            raise ValueError(_LEGACY_FUNCTIONS)
        return value

    @field_validator("tool_calls")
    @classmethod
    def _assistant_calls(cls, value: list[ToolCallOption] | None, info: ValidationInfo) -> Any:
        role = _role(info)
        if value is not None and role not in (None, "assistant"):
            raise ValueError(f"a {role} message has tool_calls; only assistant messages make calls")
        return value

    @field_validator("tool_call_id")
    @classmethod
    def _answers_a_call(cls, value: str | None, info: ValidationInfo) -> str | None:
        role = _role(info)
        if role == "tool" and not value:
            raise ValueError("a tool message needs the tool_call_id of the call it answers")
        if role not in (None, "tool") and value is not None:
            raise ValueError(f"a {role} message has a tool_call_id; only tool messages answer calls")
        return value

    @field_validator("name")
    @classmethod
    def _tool_name(cls, value: str | None, info: ValidationInfo) -> str | None:
        role = _role(info)
        if value is not None and role not in (None, "tool"):
            raise ValueError(
                f"a {role} message's name (a participant name) is not passed to the model; leave it out "
                "(only tool messages take a name: the tool's)"
            )
        return value if value is None else _check_tool_name(value)

    @field_validator("content")
    @classmethod
    def _content(cls, value: str | list[ContentPart] | None, info: ValidationInfo) -> Any:
        role = _role(info)
        if value is None and role is not None and not (role == "assistant" and info.data.get("tool_calls")):
            raise ValueError("content is required (it may be null only in an assistant message with tool_calls)")
        if role == "tool" and isinstance(value, list) and any(p.type != "text" for p in value):
            raise ValueError(
                "a tool result is text: send a string or text parts (it is a document unless "
                "spec_prefill.compress_tool_results or keep_tools_whole keep it whole)"
            )
        return value


class FunctionSchema(_Strict):
    """A function offered to the model: OpenAI's fields, rendered by the chat template."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        return _check_tool_name(value)

    @field_validator("parameters")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and value.get("type", "object") != "object":
            raise ValueError("must be a JSON schema of type 'object' (a function takes named arguments)")
        return value


class ToolOption(_Strict):
    """``{"type": "function", "function": {...}}``."""

    type: Literal["function"]
    function: FunctionSchema


class NamedFunction(_Strict):
    name: str


class NamedToolChoice(_Strict):
    """``{"type": "function", "function": {"name": ...}}``: the answer is a call to that tool."""

    type: Literal["function"]
    function: NamedFunction


class JsonSchemaFormat(_Strict):
    """``response_format.json_schema``: the answer is JSON valid for ``schema``."""

    name: str = Field(min_length=1, max_length=64)
    description: str | None = None
    schema_: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """``{"type": "text"}``, ``{"type": "json_object"}`` or ``{"type": "json_schema", "json_schema": {...}}``."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = Field(None, validate_default=True)

    @field_validator("json_schema")
    @classmethod
    def _schema_with_its_type(cls, value: JsonSchemaFormat | None, info: ValidationInfo) -> JsonSchemaFormat | None:
        kind = info.data.get("type")
        if kind == "json_schema" and value is None:
            raise ValueError("type 'json_schema' needs json_schema: {'name': ..., 'schema': {...}}")
        if kind not in (None, "json_schema") and value is not None:
            raise ValueError(f"json_schema is for type 'json_schema', not {kind!r}")
        return value

    @property
    def output_format(self) -> OutputFormat | None:
        """What decoding enforces (None: plain text)."""
        if self.json_schema is not None:  # strict unless false: unset, it is what vLLM's xgrammar backend does
            return OutputFormat(
                "json_schema", schema=self.json_schema.schema_, strict=self.json_schema.strict is not False
            )
        return OutputFormat("json_object") if self.type == "json_object" else None


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
    presence_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    frequency_penalty: float = Field(0.0, ge=-MAX_PENALTY, le=MAX_PENALTY)
    spec_prefill: SpecPrefillOptions = Field(default_factory=SpecPrefillOptions)

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value: float) -> float:
        return check_temperature(value)

    @field_validator("n")
    @classmethod
    def _one_choice(cls, value: int) -> int:
        return _neutral("n", value, (1,), "one choice per request")

    @property
    def stop_strings(self) -> tuple[str, ...]:
        if self.stop is None:
            return ()
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)


def _schemas(tools: list[ToolOption] | None) -> tuple[dict[str, Any], ...]:
    """Tools as plain dicts, exactly the fields the client sent."""
    return tuple(tool.model_dump(exclude_unset=True, by_alias=True) for tool in tools or ())


def _choice(value: str | NamedToolChoice | None) -> ToolChoice | None:
    return value if value is None or isinstance(value, str) else value.function.name


class ChatCompletionRequest(_Sampling):
    """``POST /v1/chat/completions``."""

    messages: list[Message] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_TOKENS)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    tools: list[ToolOption] | None = None
    tool_choice: Literal["auto", "none", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = Field(None, description="False: the answer makes at most one call.")
    response_format: ResponseFormat | None = None
    functions: Any = None  # legacy function calling: refused, naming the modern fields
    function_call: Any = None

    @field_validator("top_logprobs")
    @classmethod
    def _with_logprobs(cls, value: int | None, info: ValidationInfo) -> int | None:
        if value and "logprobs" in info.data and info.data["logprobs"] is not True:  # else logprobs' own error
            raise ValueError(f"top_logprobs={value} needs logprobs: true; send both, or leave top_logprobs out")
        return value

    @field_validator("tools", mode="before")
    @classmethod
    def _few_tools(cls, value: Any) -> Any:
        """At most MAX_TOOLS, counted before any tool is parsed."""
        if isinstance(value, list):
            try:
                check_tool_count(len(value))
            except InvalidRequestError as error:
                raise ValueError(str(error)) from None
        return value

    @field_validator("tools")
    @classmethod
    def _checked_tools(cls, value: list[ToolOption] | None) -> list[ToolOption] | None:
        """The checks the core makes (a tool named twice...), as a field error."""
        try:
            check_tools(_schemas(value))
        except InvalidRequestError as error:
            raise ValueError(str(error)) from None
        return value

    @field_validator("tool_choice")
    @classmethod
    def _offered_tool(cls, value: Any, info: ValidationInfo) -> Any:
        """A named tool must be one of ``tools``; ``required`` needs tools (skipped when ``tools`` is invalid)."""
        if "tools" not in info.data:
            return value
        choice = _choice(value)
        if not isinstance(value, str) and choice in ("auto", "none", "required"):
            raise ValueError(f"a tool named {choice!r} cannot be chosen by name (a tool_choice keyword); rename it")
        try:
            check_tool_choice(choice, _schemas(info.data["tools"]))
        except InvalidRequestError as error:
            raise ValueError(str(error)) from None
        return value

    @field_validator("response_format")
    @classmethod
    def _one_constraint(cls, value: ResponseFormat | None, info: ValidationInfo) -> ResponseFormat | None:
        """JSON output and tool calls cannot both be enforced on one answer."""
        if value is None or value.type == "text" or not info.data.get("tools"):
            return value
        if info.data.get("tool_choice") != "none":
            raise ValueError(
                f"response_format type {value.type!r} constrains the answer to JSON, so the offered tools could not "
                "be called; send tool_choice 'none' or leave tools out"
            )
        return value

    @field_validator("functions", "function_call")
    @classmethod
    def _no_legacy_fields(cls, value: Any) -> Any:
        if value is not None:
            raise ValueError(_LEGACY_FUNCTIONS)
        return value

    @property
    def tool_schemas(self) -> tuple[dict[str, Any], ...]:
        """The offered tools as plain OpenAI tool schemas (what the chat template reads)."""
        return _schemas(self.tools)

    @property
    def chosen_tool(self) -> ToolChoice | None:
        """``tool_choice`` as the core reads it: ``auto``, ``none``, ``required`` or a tool's name."""
        return _choice(self.tool_choice)

    @property
    def output_format(self) -> OutputFormat | None:
        """What ``response_format`` asks decoding to enforce (None: plain text)."""
        return self.response_format.output_format if self.response_format is not None else None

    @property
    def token_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def wire_names(self) -> WireNames:
        """The fields this request sent, for its errors: the one that set the token limit, and the prompt's."""
        tokens = "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"
        return WireNames(tokens, "messages")

    @property
    def logprob_fields(self) -> dict[str, Any]:
        """The :class:`~specprefill_rag.config.GenerationParams` fields of ``logprobs`` and ``top_logprobs``."""
        return {"logprobs": bool(self.logprobs), "top_logprobs": self.top_logprobs or 0}


class CompletionRequest(_Sampling):
    """``POST /v1/completions``: a text prompt (a list of one prompt is accepted)."""

    prompt: str | list[str]
    max_tokens: int | None = Field(16, ge=1, le=MAX_TOKENS)
    echo: bool = False
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LEGACY_LOGPROBS,
        description="Each token's log-probability and those of this many most likely tokens (legacy shape).",
    )
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, value: str | list[str]) -> str | list[str]:
        if isinstance(value, list) and len(value) != 1:
            raise ValueError(f"a list of {len(value)} prompts is not supported; send one prompt per request")
        return value

    @field_validator("echo", "suffix")
    @classmethod
    def _unsupported(cls, value: Any, info: Any) -> Any:
        return _neutral(info.field_name, value, (None, False), "not implemented")

    @property
    def text(self) -> str:
        return self.prompt[0] if isinstance(self.prompt, list) else self.prompt

    @property
    def token_limit(self) -> int | None:
        return self.max_tokens

    @property
    def wire_names(self) -> WireNames:
        """The fields this request sent, for its errors."""
        return WireNames("max_tokens", "prompt")

    @property
    def logprob_fields(self) -> dict[str, Any]:
        """The :class:`~specprefill_rag.config.GenerationParams` fields of the legacy integer ``logprobs``."""
        return {"logprobs": self.logprobs is not None, "top_logprobs": self.logprobs or 0}


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
