"""RAG prompt rendering: parts with roles -> token ids plus the role of every token.

A prompt is a list of :class:`~specprefill_rag.prompt.layout.Segment` s (text + role). It is tokenized
once, as one string, and each token's role comes from its character offsets: a token lying inside one
segment takes that segment's role; a token straddling two segments, or a special token, is template
scaffolding. Only document tokens are ever candidates for dropping.

Every layout keeps its source (:class:`TurnsSource` or :class:`SegmentsSource`): what it was built
from, so the same content can be laid out for another tokenizer (a draft with its own vocabulary and
chat template reads the same instructions, documents and question rendered its own way; see
:mod:`specprefill_rag.draft.paths`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

from ..arguments import check_text
from ..errors import InvalidRequestError
from .documents import rag_turns
from .layout import DocumentLike, PromptLayout, Role, Segment, Turn
from .tokens import encode_as_text, encode_trusted_controls
from .tools import template_tool_calls

# Private-use characters: not whitespace, so templates that trim message content keep them whole.
_SENTINEL = "\ue000SPR{}\ue001"


_SENTINEL_RE = re.compile("\ue000SPR(\\d+)\ue001")


def render_chat(tokenizer: Any, turns: Sequence[Turn], tools: Sequence[Mapping[str, Any]] = ()) -> list[Segment]:
    """Render turns with the tokenizer's chat template (plus generation prompt), keeping segment roles.

    Every segment is rendered as a unique sentinel, located in the output, and put back, so the text
    between sentinels is exactly what the template wrote (``scaffold``: its markup, the ``tools`` schemas
    and the turns' tool calls). The result must equal the template rendered over the real text, or the
    template is rejected. A template that trims message content (Llama 3.x) is rendered over the trimmed
    content: the same text it writes for the original.
    """
    turns = _without_empty(turns)
    original = _apply_template(tokenizer, turns, _flat(turns), tools)
    segments = _sentinel_render(tokenizer, turns, tools, original)
    if segments is None:
        trimmed = _trimmed(turns)
        if _apply_template(tokenizer, trimmed, _flat(trimmed), tools) == original:
            segments = _sentinel_render(tokenizer, trimmed, tools, original)
    if segments is not None:
        return segments
    raise InvalidRequestError(
        "the chat template rewrites or drops message content, so document spans cannot be located; "
        "pass use_chat_template=False"
    )


def _flat(turns: Sequence[Turn]) -> list[Segment]:
    return [segment for turn in turns for segment in turn.segments]


def _sentinel_render(
    tokenizer: Any, turns: Sequence[Turn], tools: Sequence[Mapping[str, Any]], real: str
) -> list[Segment] | None:
    """The rendered segments, in the order the template writes them, or None unless it writes every segment once,
    verbatim (or JSON-escaped, :func:`_as_written`); ``real``: the template's output for these turns.
    """
    flat = _flat(turns)
    marked = [Segment(_SENTINEL.format(i), s.role) for i, s in enumerate(flat)]
    rendered = _apply_template(tokenizer, turns, marked, tools)
    found = [int(m.group(1)) for m in _SENTINEL_RE.finditer(rendered)]
    segments, cursor = [], 0
    for match in _SENTINEL_RE.finditer(rendered):
        segments.append(Segment(rendered[cursor : match.start()], Role.TEMPLATE, scaffold=True))
        segments.append(flat[int(match.group(1))])
        cursor = match.end()
    segments.append(Segment(rendered[cursor:], Role.TEMPLATE, scaffold=True))
    if sorted(found) != list(range(len(flat))):  # each part written once (Mistral moves the system text later)
        return None
    if "".join(s.text for s in segments) != real:
        return _as_written(segments, real)
    return [s for s in segments if s.text]


def _as_written(pieces: list[Segment], real: str) -> list[Segment] | None:
    """The segments as a template that JSON-encodes content writes them (Llama 3.x's tool results go through
    ``tojson``), read from its real output between the scaffolding pieces; None unless every segment is
    written verbatim or JSON-escaped.
    """
    written, cursor = [], 0
    for index, piece in enumerate(pieces):
        if piece.scaffold:
            if not real.startswith(piece.text, cursor):
                return None
            written.append(piece)
            cursor += len(piece.text)
            continue
        following = pieces[index + 1].text  # a scaffold piece: sentinels alternate with them
        end = real.find(following, cursor) if following else (len(real) if index + 2 == len(pieces) else -1)
        text = real[cursor:end] if end >= 0 else None
        if text is None or text not in (piece.text, *_json_escaped(piece.text)):
            return None
        written.append(replace(piece, text=text))
        cursor = end
    return [s for s in written if s.text] if cursor == len(real) else None


def _json_escaped(text: str) -> tuple[str, str]:
    """``text`` inside a JSON string, as ``tojson`` writes it (non-ASCII kept, or escaped)."""
    return json.dumps(text, ensure_ascii=False)[1:-1], json.dumps(text)[1:-1]


def _without_empty(turns: Sequence[Turn]) -> list[Turn]:
    """Turns without empty segments: an empty content stays empty (templates test it, e.g. before tool calls)."""
    return [replace(t, segments=tuple(s for s in t.segments if s.text)) for t in turns]


def _trimmed(turns: Sequence[Turn]) -> list[Turn]:
    """Turns whose content has no leading or trailing whitespace (what trimming templates write)."""
    trimmed = []
    for turn in _without_empty(turns):
        segments = list(turn.segments)
        if segments:
            segments[0] = replace(segments[0], text=segments[0].text.lstrip())
            segments[-1] = replace(segments[-1], text=segments[-1].text.rstrip())
        trimmed.append(replace(turn, segments=tuple(s for s in segments if s.text)))
    return trimmed


def _apply_template(
    tokenizer: Any, turns: Sequence[Turn], flat: list[Segment], tools: Sequence[Mapping[str, Any]]
) -> str:
    """Render ``turns`` with their segments replaced, in order, by ``flat``."""
    pieces = iter(flat)
    chat = [_template_message(t, "".join(next(pieces).text for _ in t.segments)) for t in turns]
    return tokenizer.apply_chat_template(chat, tools=list(tools) or None, tokenize=False, add_generation_prompt=True)


def _template_message(turn: Turn, content: str) -> dict[str, Any]:
    """A turn as chat templates read it (OpenAI's message shape)."""
    message: dict[str, Any] = {"role": turn.role, "content": content}
    if turn.tool_calls:
        message["tool_calls"] = template_tool_calls(turn.tool_calls)
    if turn.tool_call_id is not None:
        message["tool_call_id"] = turn.tool_call_id
    if turn.name is not None:
        message["name"] = turn.name
    return message


def render_plain(turns: Sequence[Turn]) -> list[Segment]:
    """Render turns without a chat template: contents separated by blank lines, then ``Answer:``."""
    if any(t.tool_calls or t.role == "tool" for t in turns):
        raise InvalidRequestError(
            "tool calls and tool results need the model's chat template (it defines how they are written); "
            "use a model with a chat template and use_chat_template=True"
        )
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


def build_turns_layout(
    tokenizer: Any,
    turns: Sequence[Turn],
    use_chat_template: bool = True,
    tools: Sequence[Mapping[str, Any]] = (),
    draft_query: str | None = None,
) -> PromptLayout:
    """Layout of chat turns, rendered with the tokenizer's chat template when it has one; ``tools``: the
    checked tool schemas offered to the model (:func:`specprefill_rag.prompt.tools.check_tools`);
    ``draft_query``: text the draft reads after the prompt as its queries (``PromptLayout.draft_query_ids``).
    """
    if not turns:
        raise InvalidRequestError("no messages given; pass at least one user message")
    if use_chat_template and getattr(tokenizer, "chat_template", None):
        layout = layout_from_segments(tokenizer, render_chat(tokenizer, turns, tools), add_special_tokens=False)
    elif tools:
        raise InvalidRequestError(
            "tools need the model's chat template (it defines how tools are offered); use a model with a chat "
            "template and use_chat_template=True"
        )
    else:
        layout = layout_from_segments(tokenizer, render_plain(turns), add_special_tokens=True)
    query = torch.tensor(encode_as_text(tokenizer, draft_query)[0], dtype=torch.long) if draft_query else None
    source = TurnsSource(tuple(turns), use_chat_template, tuple(tools), draft_query)
    return replace(layout, source=source, draft_query_ids=query)


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


@dataclass(frozen=True)
class TurnsSource:
    """Chat turns: another tokenizer renders them with its own chat template (when used and present)."""

    turns: tuple[Turn, ...]
    use_chat_template: bool
    tools: tuple[Mapping[str, Any], ...] = ()
    draft_query: str | None = None

    def render(self, tokenizer: Any) -> PromptLayout:
        return build_turns_layout(tokenizer, self.turns, self.use_chat_template, self.tools, self.draft_query)


@dataclass(frozen=True)
class SegmentsSource:
    """Rendered segments, tokenized as they are by another tokenizer (template text included): the
    source of layouts built from text the caller rendered (``generate_text``).
    """

    segments: tuple[Segment, ...]
    add_special_tokens: bool

    def render(self, tokenizer: Any) -> PromptLayout:
        return layout_from_segments(tokenizer, self.segments, self.add_special_tokens)
