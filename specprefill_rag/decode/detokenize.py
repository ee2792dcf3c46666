"""Incremental detokenization with stop strings.

Text is released only when it can no longer change: an incomplete UTF-8 character at the end, or
a suffix that could still grow into a stop string, is held back. The final text ends right before
the first stop string. Special tokens are left out of the text, except ``visible`` ones (a tool-call
marker such as Mistral's ``[TOOL_CALLS]``, which the tool-call parser reads).

Each token costs a decode of a short window, not of the whole answer: the tokens since the last complete
character, with the tokens decoded the step before as context (so a tokenizer that decodes a token
differently after another, a leading space, say, is read as in the whole text). The text so far is
then the whole answer decoded at once, apart from the visible markers, whose neighbours are decoded
on their own.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

_INCOMPLETE = "\ufffd"  # what a decoder writes for the bytes of a character still to come


class IncrementalText:
    """Turn a stream of token ids into text deltas, honouring stop strings."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), visible: Mapping[int, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.visible = dict(visible or {})
        self.token_ids: list[int] = []
        self.text = ""  # the answer decoded so far, released or held back
        self.emitted = ""
        self.stopped = False
        self._context = 0  # token index where the decoding window starts (context before new tokens)
        self._read = 0  # token index of the first token not yet in ``text``

    def _window(self) -> tuple[str, bool]:
        """The text of the tokens not yet in ``text``, and whether it ends on a complete character."""
        decode = self.tokenizer.decode
        before = decode(self.token_ids[self._context : self._read], skip_special_tokens=True)
        after = decode(self.token_ids[self._context :], skip_special_tokens=True)
        if not after.startswith(before):  # the context decodes otherwise next to the new tokens: drop it
            after = decode(self.token_ids[self._read :], skip_special_tokens=True)
            return after, not after.endswith(_INCOMPLETE)
        return after[len(before) :], not after.endswith(_INCOMPLETE)

    def _advance(self, new: str) -> None:
        self.text += new
        self._context, self._read = self._read, len(self.token_ids)

    def _first_stop(self, text: str, searched: int) -> int:
        """Where the first stop string in ``text`` starts (-1: none); ``text[:searched]`` held none."""
        found = (text.find(stop, max(searched - len(stop) + 1, 0)) for stop in self.stop)
        return min((index for index in found if index >= 0), default=-1)

    def _held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:size]):
                    longest = size
                    break
        return longest

    def push(self, token_id: int) -> str:
        """Add one token; return the new text that is now certain (possibly empty)."""
        if token_id in self.visible:  # the marker, after whatever was pending (decoded as it stands)
            new, complete = self._window()[0] + self.visible[token_id], True
            self.token_ids.append(token_id)
        else:
            self.token_ids.append(token_id)
            new, complete = self._window()
        text = self.text + new
        cut = self._first_stop(text, len(self.text))
        if cut >= 0:
            self.stopped = True
            return self._release(text[:cut])
        if not complete:
            return ""
        self._advance(new)
        if token_id in self.visible:  # text after a marker is decoded on its own, with no context
            self._context = self._read
        return self._release(text[: len(text) - self._held_back(text)])

    def finish(self) -> str:
        """Release everything still held back (the stream ended without a stop string)."""
        if self.stopped:
            return ""
        self._advance(self._window()[0])
        return self._release(self.text)

    def _release(self, text: str) -> str:
        if len(text) <= len(self.emitted):
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta


def _byte_level_alphabet() -> dict[str, int]:
    """Byte-level BPE's alphabet (GPT-2, Llama 3, Qwen, SmolLM2): the printable character that stands for each
    byte in a token's piece -> that byte. Printable Latin-1 bytes stand for themselves; the other 68 bytes take
    the characters from U+0100 on, in byte order.
    """
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    others = [byte for byte in range(256) if byte not in printable]
    alphabet = {chr(byte): byte for byte in printable}
    alphabet.update({chr(256 + number): byte for number, byte in enumerate(others)})
    return alphabet


_BYTE_OF = _byte_level_alphabet()
_SAMPLE = " é€"  # a space and characters of two and three UTF-8 bytes


def _is_byte_level(tokenizer: Any) -> bool:
    """Whether the tokenizer's pieces are byte-level BPE (each character one byte of :func:`_byte_level_alphabet`)."""
    pieces = tokenizer.convert_ids_to_tokens(tokenizer.encode(_SAMPLE, add_special_tokens=False))
    try:
        return bytes(_BYTE_OF[char] for piece in pieces for char in piece) == _SAMPLE.encode()
    except (KeyError, TypeError):
        return False


class TokenPieces:
    """Each token's text and exact UTF-8 bytes, as log-probabilities report them.

    The text is the token decoded alone (special tokens included); a token holding part of a multi-byte
    character shows as U+FFFD there, while its bytes are exact on byte-level BPE tokenizers (from the piece).
    On other tokenizers the bytes are those of the text.
    """

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        self._known: dict[int, tuple[str, tuple[int, ...]]] = {}

    def __call__(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        """``(text, bytes)`` of one token."""
        if token_id not in self._known:
            self._known[token_id] = self._read(token_id)
        return self._known[token_id]

    def _read(self, token_id: int) -> tuple[str, tuple[int, ...]]:
        if self.byte_level:
            piece = self.tokenizer.convert_ids_to_tokens(token_id)
            if isinstance(piece, str) and all(char in _BYTE_OF for char in piece):
                raw = bytes(_BYTE_OF[char] for char in piece)
                return raw.decode("utf-8", errors="replace"), tuple(raw)
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text, tuple(text.encode("utf-8", errors="replace"))
