"""Incremental detokenization with stop strings.

Text is released only when it can no longer change: an incomplete UTF-8 character at the end, or
a suffix that could still grow into a stop string, is held back. The final text ends right before
the first stop string. Special tokens are left out of the text, except ``visible`` ones (a tool-call
marker such as Mistral's ``[TOOL_CALLS]``, which the tool-call parser reads).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class IncrementalText:
    """Turn a stream of token ids into text deltas, honouring stop strings."""

    def __init__(self, tokenizer: Any, stop: tuple[str, ...] = (), visible: Mapping[int, str] | None = None) -> None:
        self.tokenizer = tokenizer
        self.stop = stop
        self.visible = dict(visible or {})
        self.token_ids: list[int] = []
        self.emitted = ""
        self.stopped = False

    def _decoded(self) -> str:
        if not self.visible:
            return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        pieces: list[str] = []
        run: list[int] = []
        for token in self.token_ids:
            if token in self.visible:
                pieces += [self.tokenizer.decode(run, skip_special_tokens=True), self.visible[token]]
                run = []
            else:
                run.append(token)
        return "".join([*pieces, self.tokenizer.decode(run, skip_special_tokens=True)])

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
        self.token_ids.append(token_id)
        text = self._decoded()
        cut = min((i for i in (text.find(s) for s in self.stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            return self._release(text[:cut])
        if text.endswith("\ufffd"):
            return ""
        return self._release(text[: len(text) - self._held_back(text)])

    def finish(self) -> str:
        """Release everything still held back (the stream ended without a stop string)."""
        if self.stopped:
            return ""
        return self._release(self._decoded())

    def _release(self, text: str) -> str:
        if not text.startswith(self.emitted) or len(text) <= len(self.emitted):
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta
