"""Typed results: numbers, not formatted strings."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:  # results also travel through the torch-free gateway client
    import torch

FinishReason = Literal["stop", "length", "tool_calls"]
DraftPath = Literal["direct", "mapped", "self"]
KeepPolicy = Literal["fixed", "auto"]
# Why a request was prefilled whole: asked to keep everything or not to compress, no documents found,
# shorter than min_prompt_tokens, a vLLM server without the plugin, a failed draft, or the draft's
# budget kept every document token.
NotCompressed = Literal[
    "keep_all",
    "disabled",
    "no_documents",
    "awaiting_tool_results",
    "short_prompt",
    "no_plugin",
    "draft_error",
    "all_kept",
]


@dataclass(frozen=True)
class ToolCall:
    """One function call: made by the model (parsed from its output) or in a chat history.

    ``arguments`` is the decoded JSON object; ``id`` pairs the call with its tool result.
    """

    name: str
    arguments: Mapping[str, Any]
    id: str


@dataclass(frozen=True)
class InvalidToolCall:
    """A tool call the model wrote that could not be decoded: its raw text and why (LangChain's
    ``invalid_tool_calls`` shape). Never dropped: the caller sees it and can retry or repair.
    """

    name: str | None
    arguments: str
    id: str
    error: str


@dataclass(frozen=True)
class TopLogprob:
    """One of the most likely tokens at a step, with its log-probability (an entry of OpenAI's ``top_logprobs``).

    Attributes:
        token: the token's text, decoded alone (a piece of a multi-byte character shows as U+FFFD).
        token_id: its id in the main model's vocabulary; None when the answer came from a gateway (OpenAI's
            shape carries no ids).
        logprob: natural log of its probability, under the main model's raw distribution (before temperature,
            top-p, penalties and constraints).
        bytes: its exact UTF-8 bytes (those of a piece of a character included).
    """

    token: str
    token_id: int | None
    logprob: float
    bytes: tuple[int, ...]

    def as_openai(self) -> dict[str, Any]:
        """``{"token", "logprob", "bytes"}``, as OpenAI writes it."""
        return {"token": self.token, "logprob": self.logprob, "bytes": list(self.bytes)}


@dataclass(frozen=True)
class TokenLogprob(TopLogprob):
    """A generated token's log-probability and the most likely tokens at its step (an entry of OpenAI's
    ``logprobs.content``); the fields of :class:`TopLogprob`, and ``top_logprobs``: the request's
    ``top_logprobs`` most likely tokens, most likely first (the generated one among them when it is one of them).
    """

    top_logprobs: tuple[TopLogprob, ...] = ()

    def as_openai(self) -> dict[str, Any]:
        """``{"token", "logprob", "bytes", "top_logprobs": [...]}``, as OpenAI writes it."""
        return {**super().as_openai(), "top_logprobs": [top.as_openai() for top in self.top_logprobs]}


@dataclass(frozen=True)
class SpecPrefillStats:
    """What SpecPrefill did for one request, and how long it took.

    Attributes:
        prompt_tokens: ``L``, tokens in the full prompt.
        document_tokens: prompt tokens that belong to documents (the only candidates).
        kept_tokens: ``K``, prompt tokens the main model prefilled.
        kept_document_tokens: document tokens among them.
        keep_rate: ``kept_document_tokens / document_tokens`` (1.0 without documents or when the prompt was
            not compressed): the share actually kept. With ``keep_policy == "auto"`` this is the rate the
            engine chose for this request; with a fixed rate, that rate rounded up to whole chunks.
        compressed: whether any token was dropped.
        draft_ms: draft scoring time (0 when the prompt was not compressed).
        main_prefill_ms: main-model prefill up to the first token.
        ttft_ms: request start to first token: layout, draft, selection and main prefill.
        completion_tokens: tokens generated.
        decode_tokens_per_s: generation speed after the first token (0 with fewer than 2 tokens).
        draft_path: how the draft scored: ``direct`` (a draft of the main model's vocabulary reads its
            ids), ``mapped`` (a draft of another vocabulary, through characters), ``self`` (the main
            model's first layers); None when no draft ran (not compressed).
        draft_cached_tokens: leading tokens of the draft's prompt whose KV came from the draft prefix
            cache (0: a cold draft, or no draft call). The draft's prompt is this prompt on the direct and
            self paths (the draft prefilled ``prompt_tokens - draft_cached_tokens``), its own rendering on
            the mapped path.
        keep_policy: the keep policy the request asked for: ``fixed`` (a number) or ``auto`` (the engine
            chose the budget from the draft's importance; the chosen share is ``keep_rate``).
        reused_spans: compressed spans (documents, tool results) that kept the tokens chosen for them earlier
            in the conversation (stable selection; 0 with ``reselect``). When every span was reused no draft ran.
        draft_document_cached_tokens: draft prompt tokens whose KV came from the per-document draft cache
            (``draft_document_cache``), in ``draft_documents_cached`` documents.
        draft_documents_cached: documents whose draft KV came from that cache.
        main_cached_tokens: kept tokens whose main-model KV came from the main model's prefix cache (the
            main model prefilled ``kept_tokens - main_cached_tokens``); None when the backend does not say.
        uncompressed_reason: None when document tokens were dropped; else why the prompt went whole:
            ``keep_all`` (keep rate 1 and no cap), ``disabled`` (the request turned SpecPrefill off),
            ``no_documents`` (no retrieved documents found in it), ``awaiting_tool_results`` (none yet: tools
            offered and no tool result, an agent's first step), ``short_prompt`` (under
            ``min_prompt_tokens``), ``no_plugin`` (a vLLM server without the plugin, original positions),
            ``draft_error`` (the draft failed: see the gateway's ``draft_error``) or ``all_kept`` (the draft
            ran and its budget kept every document token).
    """

    prompt_tokens: int
    document_tokens: int
    kept_tokens: int
    kept_document_tokens: int
    keep_rate: float
    compressed: bool
    draft_ms: float
    main_prefill_ms: float
    ttft_ms: float
    completion_tokens: int
    decode_tokens_per_s: float
    draft_path: DraftPath | None = None
    draft_cached_tokens: int = 0
    keep_policy: KeepPolicy = "fixed"
    reused_spans: int = 0
    draft_document_cached_tokens: int = 0
    draft_documents_cached: int = 0
    main_cached_tokens: int | None = None
    uncompressed_reason: NotCompressed | None = None

    def as_dict(self) -> dict[str, float | int | bool | str | None]:
        return asdict(self)


@dataclass(frozen=True)
class Selection:
    """The prompt tokens the main model prefills, and what choosing them cost.

    Attributes:
        kept: ``[K]`` sorted kept prompt indices.
        draft_ms: draft scoring time (0 when nothing is compressed).
        draft_cached_tokens: leading prompt tokens the draft took from its prefix cache.
        keep_policy: the keep policy the request asked for (``fixed`` or ``auto``).
        queue_ms: time waiting for the gateway's draft queue (0 in the engine).
        batch_size: prompts in the draft batch it was scored in (0 when no draft ran).
        draft_error: why the draft failed, when the request went uncompressed because of it.
        uncompressed_reason: why no draft ran (None when one did; see :class:`SpecPrefillStats`).
        reused_spans: spans whose kept tokens came from an earlier turn (stable selection).
        draft_document_cached_tokens: draft tokens served by the per-document draft cache.
        draft_documents_cached: documents served by it.
    """

    kept: torch.Tensor
    draft_ms: float = 0.0
    draft_cached_tokens: int = 0
    keep_policy: KeepPolicy = "fixed"
    queue_ms: float = 0.0
    batch_size: int = 0
    draft_error: str | None = None
    uncompressed_reason: NotCompressed | None = None
    reused_spans: int = 0
    draft_document_cached_tokens: int = 0
    draft_documents_cached: int = 0


@dataclass(frozen=True)
class GenerationResult:
    """A finished generation."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason
    stats: SpecPrefillStats
    kept_positions: torch.Tensor | None = field(repr=False)
    """``[K]`` sorted kept prompt indices; None when the answer came from a gateway."""
    tool_calls: tuple[ToolCall, ...] = ()
    """The calls the model made (``text`` is then what it wrote outside them); ``finish_reason`` is
    ``"tool_calls"``."""
    invalid_tool_calls: tuple[InvalidToolCall, ...] = ()
    """Calls the model wrote that could not be decoded."""
    logprobs: tuple[TokenLogprob, ...] | None = None
    """One per generated token (``token_ids``; end-of-sequence excluded), when the request asked for them
    (``logprobs=True``); None otherwise."""


@dataclass(frozen=True)
class StreamChunk:
    """One piece of a streamed generation; the last chunk has ``finish_reason``, ``stats`` and ``result``."""

    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stats: SpecPrefillStats | None = None
    result: GenerationResult | None = field(default=None, repr=False)
    tool_calls: tuple[ToolCall, ...] = ()
    """Tool calls completed in this chunk (``text`` never holds their markup)."""
    logprobs: tuple[TokenLogprob, ...] | None = None
    """One per token of this chunk (``token_ids``), when the request asked for them; None otherwise."""


def chat_logprobs(logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
    """A chat choice's ``logprobs``: ``{"content": [{"token", "logprob", "bytes", "top_logprobs"}, ...]}``."""
    return None if logprobs is None else {"content": [entry.as_openai() for entry in logprobs]}


def legacy_logprobs(logprobs: Sequence[TokenLogprob] | None, offset: int = 0) -> dict[str, Any] | None:
    """A text completion's ``logprobs`` (OpenAI's legacy shape): ``tokens``, ``token_logprobs``, ``top_logprobs``
    (per token a ``{token: logprob}`` object of the most likely tokens and the sampled one, so up to ``logprobs``
    + 1 entries; tokens of equal text share an entry) and ``text_offset`` (each token's start in the answer's text,
    counting the tokens' texts from ``offset``, as vLLM does).
    """
    if logprobs is None:
        return None
    offsets = []
    for entry in logprobs:
        offsets.append(offset)
        offset += len(entry.token)
    return {
        "tokens": [entry.token for entry in logprobs],
        "token_logprobs": [entry.logprob for entry in logprobs],
        "top_logprobs": [{**{t.token: t.logprob for t in e.top_logprobs}, e.token: e.logprob} for e in logprobs],
        "text_offset": offsets,
    }


LOGPROB_FLOOR = -9999.0  # how OpenAI and vLLM's server write a log-probability of -inf (JSON has no infinity)


@dataclass(frozen=True)
class StepLogprobs:
    """One generated token's log-probability and the most likely tokens at its step, under the main model's
    raw distribution (:class:`~specprefill_rag.config.LogprobSettings`).

    Attributes:
        token_id: the generated token.
        logprob: its log-probability.
        top_ids: the ``params.top_logprobs`` most likely token ids, most likely first.
        top_logprobs: their log-probabilities, in the same order.
    """

    token_id: int
    logprob: float
    top_ids: tuple[int, ...] = ()
    top_logprobs: tuple[float, ...] = ()

    @classmethod
    def from_candidates(cls, token_id: int, candidates: Mapping[int, float], top: int) -> StepLogprobs:
        """From a server's ``{token id: log-probability}`` of one step, which holds the generated token and at
        least the ``top`` most likely (vLLM: those, plus the generated token when it is not one of them). A
        token its output constraint forbids (vLLM masks before computing them) has ``-inf``: written as
        :data:`LOGPROB_FLOOR`, as vLLM's server and OpenAI write it.
        """
        if token_id not in candidates:
            raise KeyError(f"the log-probabilities of a step do not include its token {token_id}")
        floored = {token: max(value, LOGPROB_FLOOR) for token, value in candidates.items()}
        best = sorted(floored.items(), key=lambda item: -item[1])[:top]
        return cls(token_id, floored[token_id], tuple(i for i, _ in best), tuple(v for _, v in best))


@dataclass
class PrefillReport:
    """What a backend tells about one request besides its tokens: its prefill, filled in by the time its
    generator ends, and (``params.logprobs``) each token's log-probabilities, filled in as it yields them.

    Attributes:
        cached_tokens: leading prompt tokens (of the ``K`` prefilled) whose KV the main model's prefix cache
            served, so they were not computed again; None when the backend does not report it.
        logprobs: with ``params.logprobs``, entry ``i`` is the yielded token ``i``'s, appended before that
            token is yielded; empty otherwise (nothing is computed).
    """

    cached_tokens: int | None = None
    logprobs: list[StepLogprobs] = field(default_factory=list)


WarmSkipReason = Literal["cache_full", "stopped"]
"""Why a warm-up did not draft a document: ``cache_full`` (holding it would drop an entry the cache holds),
``stopped`` (the caller's deadline passed, or its client went away, first)."""


@dataclass(frozen=True)
class SkippedDocument:
    """A document a warm-up did not hold: its index in the call and why (:data:`WarmSkipReason`)."""

    index: int
    reason: WarmSkipReason


@dataclass(frozen=True)
class WarmReport:
    """What one warm-up did: ``warmed`` documents of the call held, and each ``skipped`` one with its reason."""

    warmed: int
    skipped: tuple[SkippedDocument, ...] = ()
