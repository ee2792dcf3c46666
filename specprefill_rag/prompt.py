"""RAG prompt layout: parts with roles -> token ids plus the role of every token.

A prompt is a list of :class:`Segment` s (text + role). It is tokenized once, as one string, and
each token's role comes from its character offsets: a token lying inside one segment takes that
segment's role; a token straddling two segments, or a special token, is template scaffolding.
Only document tokens are ever candidates for dropping.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from enum import IntEnum
from typing import Any

import torch

from .arguments import check_documents, check_optional_text, check_text
from .errors import InvalidRequestError
from .prompt_sources import PromptSource, SegmentsSource, TurnsSource
from .tokens import encode_trusted_controls


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
    """

    input_ids: torch.Tensor
    roles: torch.Tensor
    document_index: torch.Tensor
    text: str
    offsets: torch.Tensor | None = None
    document_spans: torch.Tensor | None = None
    source: PromptSource | None = None

    def __len__(self) -> int:
        return int(self.input_ids.numel())

    @property
    def n_document_tokens(self) -> int:
        return int((self.document_index >= 0).sum())


_DOCUMENT_KEYS = ("text", "title", "id")


def as_document(value: DocumentLike, index: int) -> Document:
    """Validate a document given as text, UTF-8 bytes, a mapping with text/title/id, or a Document.

    Text must be valid Unicode and not blank, the title a non-blank str or None, the id a str or None;
    nothing is coerced (``{"text": None}`` is refused, not sent as the word ``None``).
    """
    name = f"document {index}"
    if isinstance(value, bytes):
        value = _decode_utf8(value, name)
    if isinstance(value, str):
        value = Document(value)
    elif isinstance(value, Mapping):
        value = _mapping_document(value, name)
    if not isinstance(value, Document):
        raise InvalidRequestError(
            f"{name} has type {type(value).__name__}; pass str, bytes, Document or a mapping with 'text'"
        )
    if isinstance(value.text, str) and not value.text.strip():
        raise InvalidRequestError(f"{name} is empty; drop it before calling")
    text = check_text(value.text, f"{name}'s text", "document text")
    title = check_optional_text(value.title, f"{name}'s title", "title")
    if value.id is not None and not isinstance(value.id, str):
        raise InvalidRequestError(f"{name}'s id must be a str or None, got {type(value.id).__name__}; pass str(id)")
    return Document(text, title, value.id)


def _decode_utf8(value: bytes, name: str) -> str:
    try:
        return value.decode("utf-8")
    except UnicodeDecodeError as error:
        raise InvalidRequestError(
            f"{name} is not valid UTF-8 (byte {error.start}: {value[error.start : error.start + 4]!r}); "
            "decode it with its real encoding before passing it"
        ) from None


def _mapping_document(value: Mapping[str, Any], name: str) -> Document:
    if "text" not in value:
        raise InvalidRequestError(f"{name} is a mapping without a 'text' key; give text, title and id")
    unknown = sorted(str(key) for key in value if key not in _DOCUMENT_KEYS)
    if unknown:
        raise InvalidRequestError(
            f"{name} has unknown keys {unknown}; a document mapping takes 'text' and optionally 'title' and 'id': "
            "drop the others"
        )
    return Document(value["text"], value.get("title"), value.get("id"))


@dataclass(frozen=True)
class Turn:
    """One chat message: a role name understood by chat templates and its content as segments."""

    role: str
    segments: tuple[Segment, ...]

    @property
    def text(self) -> str:
        return "".join(s.text for s in self.segments)


def document_segments(documents: Sequence[DocumentLike], first_index: int = 0) -> list[Segment]:
    """Validated documents as labelled segments: ``Document [i] title`` (template), then the text."""
    segments: list[Segment] = []
    for offset, raw in enumerate(check_documents(documents)):
        index = first_index + offset
        document = as_document(raw, index)
        label = f"Document [{index + 1}]" + (f" {document.title}" if document.title else "")
        segments += [Segment(f"{label}\n", Role.TEMPLATE), Segment(document.text.strip(), Role.DOCUMENT, index)]
        segments.append(Segment("\n\n", Role.TEMPLATE))
    return segments


def rag_turns(question: str, documents: Sequence[DocumentLike], instructions: str | None) -> list[Turn]:
    """Validate a RAG request and lay it out as ``[system?, user]`` turns; the question comes last."""
    question = check_text(question, "question", "user's question")
    instructions = check_optional_text(instructions, "instructions", "system instructions")
    user = document_segments(documents) + [
        Segment("Question: ", Role.TEMPLATE),
        Segment(question.strip(), Role.QUESTION),
    ]
    system = [Turn("system", (Segment(instructions, Role.INSTRUCTION),))] if instructions else []
    return system + [Turn("user", tuple(user))]


# Private-use characters: not whitespace, so templates that trim message content keep them whole.
_SENTINEL = "\ue000SPR{}\ue001"
_SENTINEL_RE = re.compile("\ue000SPR(\\d+)\ue001")


def render_chat(tokenizer: Any, turns: Sequence[Turn]) -> list[Segment]:
    """Render turns with the tokenizer's chat template (plus generation prompt), keeping segment roles.

    Every segment is rendered as a unique sentinel, located in the output, and put back, so the text
    between sentinels is exactly what the template wrote (``scaffold``). The result must equal the
    template rendered over the real text, or the template is rejected.
    """
    flat = [segment for turn in turns for segment in turn.segments]
    marked = [Segment(_SENTINEL.format(i), s.role) for i, s in enumerate(flat)]
    rendered = _apply_template(tokenizer, turns, marked)
    found = [int(m.group(1)) for m in _SENTINEL_RE.finditer(rendered)]
    segments, cursor = [], 0
    for match in _SENTINEL_RE.finditer(rendered):
        segments.append(Segment(rendered[cursor : match.start()], Role.TEMPLATE, scaffold=True))
        segments.append(flat[int(match.group(1))])
        cursor = match.end()
    segments.append(Segment(rendered[cursor:], Role.TEMPLATE, scaffold=True))
    if found != list(range(len(flat))) or "".join(s.text for s in segments) != _apply_template(tokenizer, turns, flat):
        raise InvalidRequestError(
            "the chat template reorders or rewrites message content, so document spans cannot be located; "
            "pass use_chat_template=False"
        )
    return [s for s in segments if s.text]


def _apply_template(tokenizer: Any, turns: Sequence[Turn], flat: list[Segment]) -> str:
    """Render ``turns`` with their segments replaced, in order, by ``flat``."""
    pieces = iter(flat)
    chat = [{"role": t.role, "content": "".join(next(pieces).text for _ in t.segments)} for t in turns]
    return tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)


def render_plain(turns: Sequence[Turn]) -> list[Segment]:
    """Render turns without a chat template: contents separated by blank lines, then ``Answer:``."""
    segments: list[Segment] = []
    for turn in turns:
        if turn.role == "assistant":
            segments.append(Segment("Answer: ", Role.TEMPLATE))
        segments += [*turn.segments, Segment("\n\n", Role.TEMPLATE)]
    return segments[:-1] + [Segment("\nAnswer:", Role.TEMPLATE)]


def layout_from_segments(tokenizer: Any, segments: Sequence[Segment], add_special_tokens: bool) -> PromptLayout:
    """Tokenize the concatenated segments once and give every token its segment's role.

    Special-token strings become control tokens only inside ``scaffold`` segments (see :mod:`.tokens`).
    """
    if not getattr(tokenizer, "is_fast", False):
        raise InvalidRequestError("a fast (Rust) tokenizer is required to locate document spans by offsets")
    text = "".join(s.text for s in segments)
    starts = torch.tensor([0] + [len(s.text) for s in segments]).cumsum(0)
    trusted = [(int(starts[i]), int(starts[i + 1])) for i, s in enumerate(segments) if s.scaffold]
    input_ids, offsets = encode_trusted_controls(tokenizer, text, trusted, add_special_tokens)
    token_starts, token_ends = offsets[:, 0].contiguous(), offsets[:, 1].contiguous()
    first = torch.searchsorted(starts, token_starts, right=True) - 1
    last = torch.searchsorted(starts, (token_ends - 1).clamp(min=0), right=True) - 1
    inside = (first == last) & (token_ends > token_starts)
    segment_roles = torch.tensor([int(s.role) for s in segments] + [Role.TEMPLATE])
    segment_documents = torch.tensor([s.document for s in segments] + [-1])
    index = torch.where(inside, first, torch.full_like(first, len(segments)))
    roles = segment_roles[index]
    document_index = torch.where(roles == Role.DOCUMENT, segment_documents[index], torch.full_like(index, -1))
    source = SegmentsSource(tuple(segments), add_special_tokens)
    return PromptLayout(input_ids, roles, document_index, text, offsets, _document_spans(segments), source)


def _document_spans(segments: Sequence[Segment]) -> torch.Tensor:
    """``[S, 2]`` long ``(start, end)`` of the non-empty document segments in the joined text."""
    spans, cursor = [], 0
    for segment in segments:
        if segment.role == Role.DOCUMENT and segment.text:
            spans.append((cursor, cursor + len(segment.text)))
        cursor += len(segment.text)
    return torch.tensor(spans, dtype=torch.long).view(-1, 2)


def build_turns_layout(tokenizer: Any, turns: Sequence[Turn], use_chat_template: bool = True) -> PromptLayout:
    """Layout of chat turns, rendered with the tokenizer's chat template when it has one."""
    if not turns:
        raise InvalidRequestError("no messages given; pass at least one user message")
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        layout = layout_from_segments(tokenizer, render_chat(tokenizer, turns), add_special_tokens=False)
    else:
        layout = layout_from_segments(tokenizer, render_plain(turns), add_special_tokens=True)
    return replace(layout, source=TurnsSource(tuple(turns), use_chat_template))


def build_rag_layout(
    tokenizer: Any,
    question: str,
    documents: Sequence[DocumentLike],
    instructions: str | None = None,
    use_chat_template: bool = True,
) -> PromptLayout:
    """Layout of a RAG prompt: instructions (system), documents and question (user), generation prompt."""
    return build_turns_layout(tokenizer, rag_turns(question, documents, instructions), use_chat_template)


def protect_tail(layout: PromptLayout, n_tokens: int) -> PromptLayout:
    """Mark the last ``n_tokens`` document tokens as question (kept): for prompts whose question is
    not separated from the retrieved text, such as a raw prompt or an unmarked chat message.
    """
    candidates = torch.nonzero(layout.document_index >= 0).flatten()[-n_tokens:]
    roles, document_index = layout.roles.clone(), layout.document_index.clone()
    roles[candidates] = Role.QUESTION
    document_index[candidates] = -1
    return replace(layout, roles=roles, document_index=document_index)


def build_text_layout(
    tokenizer: Any, prompt: str, protect_tail_tokens: int, parse_special_tokens: bool = False
) -> PromptLayout:
    """Layout of an already-rendered prompt with no roles.

    Every token is a candidate except special tokens (template scaffolding) and the last
    ``protect_tail_tokens`` (taken as the question). Runs between special tokens are separate
    pseudo-documents, so no chunk spans a special token.

    ``parse_special_tokens=False`` (default): the prompt may hold untrusted text, so special-token
    strings in it stay text and the tokenizer adds its own tokens (e.g. BOS). ``True``: the prompt was
    rendered by the caller from trusted parts (a chat template), and its special-token strings are
    control tokens, as the tokenizer reads them.
    """
    check_text(prompt, "prompt", "rendered prompt text")
    trusted = [(0, len(prompt))] if parse_special_tokens else []
    add_special_tokens = not parse_special_tokens
    input_ids, offsets = encode_trusted_controls(tokenizer, prompt, trusted, add_special_tokens)
    special = torch.isin(input_ids, torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long))
    roles = torch.where(special, Role.TEMPLATE, Role.DOCUMENT).long()
    roles[-protect_tail_tokens:] = torch.where(special[-protect_tail_tokens:], Role.TEMPLATE, Role.QUESTION)
    pseudo_document = torch.cumsum(special.long(), 0)
    document_index = torch.where(roles == Role.DOCUMENT, pseudo_document, torch.full_like(pseudo_document, -1))
    segments = _run_segments(prompt, offsets, pseudo_document, special, parse_special_tokens)
    source = SegmentsSource(segments, add_special_tokens)
    return PromptLayout(input_ids, roles, document_index, prompt, offsets, _document_spans(segments), source)


def _run_segments(
    prompt: str, offsets: torch.Tensor, pseudo_document: torch.Tensor, special: torch.Tensor, scaffold: bool
) -> tuple[Segment, ...]:
    """The prompt cut into its runs of ordinary tokens (pseudo-documents) and the text between them."""
    segments, cursor = [], 0
    for run in pseudo_document[~special].unique().tolist():
        members = offsets[(pseudo_document == run) & ~special]
        start, end = int(members[:, 0].min()), int(members[:, 1].max())
        if end <= start:  # only zero-width tokens (added by the tokenizer): no text to render
            continue
        segments.append(Segment(prompt[cursor:start], Role.TEMPLATE, scaffold=scaffold))
        segments.append(Segment(prompt[start:end], Role.DOCUMENT, run))
        cursor = end
    segments.append(Segment(prompt[cursor:], Role.TEMPLATE, scaffold=scaffold))
    return tuple(s for s in segments if s.text)
