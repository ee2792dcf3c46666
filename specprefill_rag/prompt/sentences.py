"""Where sentences start in a prompt's tokens, from the rendered text and each token's character span.

Selection with ``chunking="sentences"`` packs whole sentences into chunks (:mod:`specprefill_rag.selection.chunks`),
so the main model never reads a sentence cut mid-way where a dropped chunk began.
"""

from __future__ import annotations

import re

import torch

# A sentence ends after ., ! or ? (and any closing quotes or brackets) followed by whitespace, after the full-width
# 。！？ (Chinese and Japanese write no space after them), or at a line break. The boundary is the first character
# after the punctuation, or after the line break.
_SENTENCE_END = re.compile(r"[.!?][\"'”’)\]]*(?=\s)|[。！？][」』”）]*|\n+")


def boundary_chars(text: str) -> torch.Tensor:
    """``[B]`` long, increasing: the character offsets in ``text`` where a new sentence may begin."""
    return torch.tensor([match.end() for match in _SENTENCE_END.finditer(text)], dtype=torch.long)


def sentence_starts(text: str, offsets: torch.Tensor) -> torch.Tensor:
    """``[L]`` bool: token i starts a sentence, i.e. a boundary lies after token i-1's start and at or before
    token i's (a token with a leading space, `` The``, starts the sentence whose space it carries).

    Args:
        text: the rendered prompt.
        offsets: ``[L, 2]`` long character span of each token in ``text``.
    """
    starts = offsets[:, 0].contiguous()
    boundaries = boundary_chars(text)
    passed = torch.searchsorted(boundaries, starts, right=True)  # [L] boundaries at or before each token's start
    previous = torch.cat([passed.new_zeros(1), passed[:-1]])
    return passed > previous
