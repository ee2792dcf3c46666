"""A draft's token importance carried onto the main model's tokens through the documents' characters.

Pure tensor code, no models: the mapped path, for a draft with another vocabulary. Both prompts
hold the same documents' text, each rendered by its own tokenizer and template, so the documents'
text spans, joined in prompt order, give one axis of ``C`` *content characters* that both share.

1. Each draft token's importance lands on the content characters it covers. A draft token that
   straddles a document's edge lands on that document's characters only; characters covered by
   several tokens (the bytes of one emoji) take the max of them.
2. Content characters that no draft token covers (whitespace that some tokenizers leave outside
   their offsets) take the value of the nearest covered character of the same document span; a span
   with no covered character at all scores 0.
3. Each main document token takes the ``max`` (or ``mean``) over its characters: the max, or the
   mean weighted by shared characters, of the draft tokens that overlap it.

A score therefore only ever lands on characters of the span its draft token covered: never on
another document, and never on text outside documents.
"""

from __future__ import annotations

from typing import Literal

import torch

Reduce = Literal["max", "mean"]
_SCATTER = {"max": "amax", "mean": "mean"}


def ranges(starts: torch.Tensor, lengths: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Concatenated ``arange(starts[i], starts[i] + lengths[i])``.

    Args:
        starts: ``[N]`` long.
        lengths: ``[N]`` long, ``>= 0``.

    Returns:
        ``([sum(lengths)] long positions, [sum(lengths)] long owner)``: each position and the ``i`` it came from.
    """
    owner = torch.repeat_interleave(torch.arange(starts.numel(), device=starts.device), lengths)
    first = torch.cumsum(lengths, 0) - lengths
    steps = torch.arange(owner.numel(), device=starts.device) - first[owner]
    return starts[owner] + steps, owner


def content_index(document_spans: torch.Tensor, text_length: int) -> torch.Tensor:
    """``[text_length]`` long: the content character of every text character, ``-1`` outside documents.

    Args:
        document_spans: ``[S, 2]`` long ``(start, end)`` of the document spans, in prompt order, disjoint.
    """
    index = torch.full((text_length,), -1, dtype=torch.long)
    characters, _ = ranges(document_spans[:, 0], document_spans[:, 1] - document_spans[:, 0])
    index[characters] = torch.arange(characters.numel())
    return index


def character_scores(
    importance: torch.Tensor, offsets: torch.Tensor, content: torch.Tensor, n_content: int
) -> torch.Tensor:
    """Draft importance per content character (step 1); NaN where no draft token lies.

    Args:
        importance: ``[L]`` float, one per draft token.
        offsets: ``[L, 2]`` long character span of each draft token in the draft's text.
        content: ``[T]`` long from :func:`content_index` of the draft's text.
        n_content: ``C``.

    Returns:
        ``[C]`` float32.
    """
    characters, owner = ranges(offsets[:, 0], (offsets[:, 1] - offsets[:, 0]).clamp(min=0))
    target = content[characters]
    inside = target >= 0
    scores = torch.full((n_content,), float("nan"), dtype=torch.float32)
    values = importance.float()[owner[inside]]
    return scores.scatter_reduce(0, target[inside], values, reduce="amax", include_self=False)


def fill_gaps(scores: torch.Tensor, document_spans: torch.Tensor) -> torch.Tensor:
    """NaN content characters take the nearest covered character's value within their span (step 2).

    Args:
        scores: ``[C]`` float, NaN where uncovered.
        document_spans: ``[S, 2]`` long; span ``s`` holds content characters in the order given.

    Returns:
        ``[C]`` float32, no NaN (0 for a span without any covered character).
    """
    lengths = document_spans[:, 1] - document_spans[:, 0]
    span_end = torch.cumsum(lengths, 0)
    span_of = torch.repeat_interleave(torch.arange(lengths.numel()), lengths)
    first, last = (span_end - lengths)[span_of], span_end[span_of]
    positions = torch.arange(scores.numel())
    covered = ~torch.isnan(scores)
    before = torch.cummax(torch.where(covered, positions, -1), 0).values
    after = torch.cummin(torch.where(covered, positions, scores.numel()).flip(0), 0).values.flip(0)
    has_before, has_after = before >= first, after < last
    take_after = has_after & (~has_before | (after - positions < positions - before))
    nearest = torch.where(take_after, after, before).clamp(0, max(scores.numel() - 1, 0))
    filled = torch.where(has_before | has_after, scores[nearest], torch.zeros_like(scores))
    return torch.where(covered, scores, filled)


def token_scores(
    scores: torch.Tensor, offsets: torch.Tensor, document_index: torch.Tensor, content: torch.Tensor, reduce: Reduce
) -> torch.Tensor:
    """Main-token importance from content-character scores (step 3).

    Args:
        scores: ``[C]`` float, no NaN.
        offsets: ``[L, 2]`` long character span of each main token in the main text.
        document_index: ``[L]`` long, ``>= 0`` for the document tokens (each lies inside one span).
        content: ``[T]`` long from :func:`content_index` of the main text.
        reduce: ``"max"`` or ``"mean"`` over each token's characters.

    Returns:
        ``[L]`` float32, 0 for tokens outside documents.
    """
    documents = torch.nonzero(document_index >= 0).flatten()
    starts = content[offsets[documents, 0]]
    lengths = (offsets[documents, 1] - offsets[documents, 0]).clamp(min=1)
    characters, owner = ranges(starts.clamp(min=0), torch.where(starts >= 0, lengths, 0))
    reduced = torch.zeros(documents.numel(), dtype=torch.float32)
    reduced = reduced.scatter_reduce(0, owner, scores[characters], reduce=_SCATTER[reduce], include_self=False)
    result = torch.zeros(document_index.numel(), dtype=torch.float32)
    result[documents] = reduced
    return result


def map_importance(
    importance: torch.Tensor,
    draft_offsets: torch.Tensor,
    draft_spans: torch.Tensor,
    main_offsets: torch.Tensor,
    main_document_index: torch.Tensor,
    main_spans: torch.Tensor,
    reduce: Reduce = "max",
) -> torch.Tensor:
    """Draft-token importance -> main-token importance, through the documents' characters.

    Args:
        importance: ``[Ld]`` float, the draft's importance of its own tokens.
        draft_offsets: ``[Ld, 2]`` long character spans of the draft tokens in the draft's text.
        draft_spans: ``[S, 2]`` long document spans in the draft's text.
        main_offsets: ``[Lm, 2]`` long character spans of the main tokens in the main text.
        main_document_index: ``[Lm]`` long, ``>= 0`` for the main document tokens.
        main_spans: ``[S, 2]`` long, the same documents' spans in the main text (same lengths, same order).
        reduce: how a main token combines the draft tokens it overlaps.

    Returns:
        ``[Lm]`` float32: every main document token scored, 0 elsewhere.
    """
    draft_lengths, main_lengths = draft_spans[:, 1] - draft_spans[:, 0], main_spans[:, 1] - main_spans[:, 0]
    if not torch.equal(draft_lengths, main_lengths):
        raise ValueError(f"the layouts' document spans differ: {draft_lengths.tolist()} vs {main_lengths.tolist()}")
    draft_content = content_index(draft_spans, _extent(draft_offsets, draft_spans))
    scores = character_scores(importance, draft_offsets, draft_content, int(draft_lengths.sum()))
    main_content = content_index(main_spans, _extent(main_offsets, main_spans))
    return token_scores(fill_gaps(scores, draft_spans), main_offsets, main_document_index, main_content, reduce)


def _extent(offsets: torch.Tensor, spans: torch.Tensor) -> int:
    """Characters of text that ``offsets`` and ``spans`` reach into."""
    return max((int(t.max()) for t in (offsets, spans) if t.numel()), default=0)
