"""What a prompt layout was built from, kept so the same content can be laid out for another tokenizer.

A draft with its own vocabulary (and chat template) cannot read the main model's token ids; it reads
the same instructions, documents and question rendered its own way (see :mod:`.layout_scoring`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:  # prompt.py imports this module; the builders are imported where they run
    from .prompt import PromptLayout, Segment, Turn


class PromptSource(Protocol):
    """Renders a layout's content for any tokenizer."""

    def render(self, tokenizer: Any) -> PromptLayout:
        """The layout of the same content with ``tokenizer`` (and its chat template, if used)."""
        ...


@dataclass(frozen=True)
class TurnsSource:
    """Chat turns: another tokenizer renders them with its own chat template (when used and present)."""

    turns: tuple[Turn, ...]
    use_chat_template: bool

    def render(self, tokenizer: Any) -> PromptLayout:
        from .prompt import build_turns_layout

        return build_turns_layout(tokenizer, self.turns, self.use_chat_template)


@dataclass(frozen=True)
class SegmentsSource:
    """Rendered segments, tokenized as they are by another tokenizer (template text included): the
    source of layouts built from text the caller rendered (``generate_text``).
    """

    segments: tuple[Segment, ...]
    add_special_tokens: bool

    def render(self, tokenizer: Any) -> PromptLayout:
        from .prompt import layout_from_segments

        return layout_from_segments(tokenizer, self.segments, self.add_special_tokens)
