"""Tokenizing untrusted text as text: only the chat template's own scaffolding yields control tokens.

Retrieved documents, titles, the question and the instructions may contain the literal strings of
special tokens (``<|im_end|>``, ``<|start_header_id|>``, ``[INST]``...). A tokenizer matches those
strings anywhere in its input, so a document could open a system turn of its own. Here the prompt is
split at the added tokens found inside *trusted* text only (what the chat template wrote); every run
between them is encoded by a copy of the tokenizer that has no added tokens at all, so a special-token
string inside it becomes ordinary text tokens. For a prompt without such strings the result equals
what the tokenizer gives for the whole string: it splits at added tokens and encodes the runs
between them independently in the same way.
"""

from __future__ import annotations

import json
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import torch

_text_only: weakref.WeakKeyDictionary[Any, Any] = weakref.WeakKeyDictionary()
_text_only_lock = threading.Lock()


def text_only_tokenizer(tokenizer: Any) -> Any:
    """A ``tokenizers.Tokenizer`` like ``tokenizer``'s but without added tokens, truncation or padding.

    Cached per tokenizer object. Its ids are the same as the original's for ordinary text.
    """
    with _text_only_lock:
        cached = _text_only.get(tokenizer)
        if cached is None:
            from tokenizers import Tokenizer

            spec = json.loads(tokenizer.backend_tokenizer.to_str())
            spec.update(added_tokens=[], truncation=None, padding=None)
            cached = _text_only[tokenizer] = Tokenizer.from_str(json.dumps(spec))
        return cached


def added_token_ids(tokenizer: Any) -> frozenset[int]:
    """Ids of every added token (special or not): the tokens a string can only produce by matching them."""
    return frozenset(int(i) for i in tokenizer.added_tokens_decoder)


def control_spans(tokenizer: Any, text: str, offset: int = 0) -> list[tuple[int, int, int]]:
    """``(start, end, token_id)`` of every added token the tokenizer finds in trusted ``text``,
    character positions shifted by ``offset``.
    """
    added = added_token_ids(tokenizer)
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return [
        (start + offset, end + offset, int(token))
        for token, (start, end) in zip(encoded["input_ids"], encoded["offset_mapping"])
        if int(token) in added
    ]


def encode_as_text(
    tokenizer: Any, text: str, offset: int = 0, add_special_tokens: bool = False
) -> tuple[list[int], list[tuple[int, int]]]:
    """Ids and character offsets of ``text`` with every special-token string taken as text."""
    encoding = text_only_tokenizer(tokenizer).encode(text, add_special_tokens=add_special_tokens)
    return list(encoding.ids), [(start + offset, end + offset) for start, end in encoding.offsets]


def encode_trusted_controls(
    tokenizer: Any, text: str, trusted: Sequence[tuple[int, int]], add_special_tokens: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize ``text`` where only the character ranges ``trusted`` may produce control tokens.

    Args:
        text: the whole prompt.
        trusted: ``(start, end)`` ranges written by the chat template itself.
        add_special_tokens: let the tokenizer's post-processor add its own tokens (e.g. BOS) around
            the whole prompt; only for prompts without trusted control tokens.

    Returns:
        ``([L] long ids, [L, 2] long character offsets)``.
    """
    spans = sorted(span for start, end in trusted for span in control_spans(tokenizer, text[start:end], start))
    if add_special_tokens and spans:
        raise ValueError("add_special_tokens applies to prompts whose control tokens come from the tokenizer alone")
    ids: list[int] = []
    offsets: list[tuple[int, int]] = []
    cursor = 0
    for start, end, token in [*spans, (len(text), len(text), -1)]:
        run_ids, run_offsets = encode_as_text(tokenizer, text[cursor:start], cursor, add_special_tokens)
        ids += run_ids
        offsets += run_offsets
        if token >= 0:
            ids.append(token)
            offsets.append((start, end))
        cursor = end
    return torch.tensor(ids, dtype=torch.long), torch.tensor(offsets, dtype=torch.long).view(-1, 2)


# count_tokens_at_least cuts text into pieces of about this many characters; each cut may change the count
# by a few tokens (a word split in two, a prefix space), which the bound gives back.
_PIECE_CHARS = 16384
_CUT_SLACK_TOKENS = 4
_CUT_WINDOW = 256


def _cut(text: str, start: int) -> int:
    """End of the piece starting at ``start``: before a single space that precedes a word near
    ``start + _PIECE_CHARS`` (where pre-tokenizers split anyway), else exactly there.
    """
    end = start + _PIECE_CHARS
    if end >= len(text):
        return len(text)
    for cut in range(end, max(start + 1, end - _CUT_WINDOW), -1):
        if text[cut] == " " and not text[cut - 1].isspace() and not text[cut + 1 : cut + 2].isspace():
            return cut
    return end


def count_tokens_at_least(tokenizer: Any, texts: Sequence[str], limit: int, as_text: bool = True) -> int:
    """A lower bound on the tokens of ``texts``, or a number above ``limit``.

    ``as_text``: special-token strings count as the text they are (untrusted text); else as the control
    tokens they match (a client's own rendering; pieces are cut at spaces, which no special token holds).
    Counted piece by piece and stopped as soon as the bound passes ``limit``, so an oversized request
    costs memory for one piece and time for about ``limit`` tokens, not for its whole size.
    """
    encoder = text_only_tokenizer(tokenizer) if as_text else tokenizer.backend_tokenizer
    total, cuts = 0, 0
    for text in texts:
        start = 0
        while start < len(text):
            end = _cut(text, start)
            total += len(encoder.encode(text[start:end], add_special_tokens=False).ids)
            cuts += end < len(text)
            if total - _CUT_SLACK_TOKENS * cuts > limit:
                return total - _CUT_SLACK_TOKENS * cuts
            start = end
    return max(total - _CUT_SLACK_TOKENS * cuts, 0)
