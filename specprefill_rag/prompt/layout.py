"""Prompt layout data: text parts with roles, chat turns, and a tokenized prompt with the role of
every token. A leaf of the prompt package: its other modules build these.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import IntEnum
from typing import Any, Protocol

import torch

from ..errors import InvalidRequestError
from ..results import ToolCall
from .sentences import sentence_starts


class Role(IntEnum):
    """What a prompt token is. Only ``DOCUMENT`` tokens may be dropped."""

    TEMPLATE = 0
    INSTRUCTION = 1
    DOCUMENT = 2
    QUESTION = 3


@dataclass(frozen=True)
class Document:
    """One retrieved document."""

    text: str
    title: str | None = None
    id: str | None = None


DocumentLike = Document | str | bytes | Mapping[str, Any]


@dataclass(frozen=True)
class Segment:
    """A piece of prompt text with its role; ``document`` is the document index for ``Role.DOCUMENT``.

    ``scaffold``: text the chat template itself wrote. Only there do special-token strings become
    control tokens; everywhere else (documents, titles, question, instructions) they are text.
    """

    text: str
    role: Role
    document: int = -1
    scaffold: bool = False


@dataclass(frozen=True)
class PromptLayout:
    """A tokenized prompt with roles.

    Attributes:
        input_ids: ``[L]`` long token ids.
        roles: ``[L]`` long, a :class:`Role` per token.
        document_index: ``[L]`` long, document of each document token, ``-1`` elsewhere.
        text: the rendered prompt.
        offsets: ``[L, 2]`` long character span of each token in ``text`` (empty for tokens the
            tokenizer adds, e.g. BOS); None for a layout built by hand.
        document_spans: ``[S, 2]`` long ``(start, end)`` in ``text`` of every document's text, in
            prompt order (a document whose text is split by the template has several).
        source: what to render for another tokenizer; None for a layout built by hand.
        draft_query_ids: ``[Q]`` long ids the draft reads after the prompt as its queries, never prefilled by
            the main model: after a tool result, the pending call's arguments and the question restated, then
            ``Answer:``
            (the attention of the prompt's last tokens would otherwise score the documents against the tool
            result); None: the prompt's own last tokens are the queries (the paper).
        awaits_tool_results: a chat that offers tools and holds no tool result yet (an agent's first step): its
            documents come later, as tool results, so unless it marks documents it goes whole (no fallback
            pseudo-documents) as ``awaiting_tool_results``, not ``no_documents``.
    """

    input_ids: torch.Tensor
    roles: torch.Tensor
    document_index: torch.Tensor
    text: str
    offsets: torch.Tensor | None = None
    document_spans: torch.Tensor | None = None
    source: PromptSource | None = None
    draft_query_ids: torch.Tensor | None = None
    awaits_tool_results: bool = False

    def __len__(self) -> int:
        return int(self.input_ids.numel())

    @property
    def n_document_tokens(self) -> int:
        return int((self.document_index >= 0).sum())

    def sentence_starts(self) -> torch.Tensor:
        """``[L]`` bool, the tokens that start a sentence of :attr:`text`; every token for a layout built by hand
        (no offsets), whose chunks are then cut every ``chunk_size`` tokens.
        """
        if self.offsets is None:
            return torch.ones(len(self), dtype=torch.bool)
        return sentence_starts(self.text, self.offsets)


def document_runs(document_index: torch.Tensor) -> torch.Tensor:
    """``[L]`` document ids (``-1`` outside documents) -> ``[S, 2]`` long ``(start, end)`` of each run of
    one document's consecutive tokens, in prompt order.
    """
    previous = torch.cat([document_index.new_full((1,), -1), document_index[:-1]])
    following = torch.cat([document_index[1:], document_index.new_full((1,), -1)])
    inside = document_index >= 0
    starts = torch.nonzero(inside & (document_index != previous)).flatten()
    ends = torch.nonzero(inside & (document_index != following)).flatten() + 1
    return torch.stack([starts, ends], dim=1)


def instructions_end(roles: torch.Tensor, first_document: int) -> int:
    """The prompt's shared prefix before its documents: ``[L]`` roles -> the number of tokens up to the last
    instruction token before ``first_document``. What follows it (labels, turn markers, a question put first)
    depends on the request; the per-document draft cache keys documents by this prefix. 1 (the first token,
    where attention sinks) when no instruction comes before the documents.
    """
    instructions = torch.nonzero(roles[:first_document] == Role.INSTRUCTION).flatten()
    return int(instructions[-1]) + 1 if instructions.numel() else 1


@dataclass(frozen=True)
class Turn:
    """One chat message: a role name understood by chat templates and its content as segments.

    ``tool_calls``: an assistant turn's calls (the template writes their JSON); ``tool_call_id`` and ``name``:
    a tool turn's call id and tool name.
    """

    role: str
    segments: tuple[Segment, ...]
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str | None = None
    name: str | None = None

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments)


class PromptSource(Protocol):
    """What a layout was built from: renders the same content for any tokenizer (a draft with its own
    vocabulary and chat template reads it rendered its own way).
    """

    def render(self, tokenizer: Any) -> PromptLayout:
        """The layout of the same content with ``tokenizer`` (and its chat template, if used)."""
        ...


def check_layout(layout: Any, vocab_size: int) -> None:
    """A non-empty :class:`~specprefill_rag.prompt.PromptLayout` whose ids are in the vocabulary."""
    if not isinstance(layout, PromptLayout):
        raise InvalidRequestError(
            f"layout must be a PromptLayout, got {type(layout).__name__}; build it with engine.layout(question, "
            "documents) or engine.text_layout(prompt)"
        )
    ids = layout.input_ids
    lengths = {ids.numel(), layout.roles.numel(), layout.document_index.numel()}
    if ids.dim() != 1 or len(lengths) != 1 or ids.numel() == 0:
        raise InvalidRequestError(
            "layout is empty or its input_ids, roles and document_index differ in shape; rebuild it"
        )
    if ids.is_floating_point() or int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise InvalidRequestError(
            f"layout has token ids outside this tokenizer's vocabulary of {vocab_size}; build it with this engine"
        )
