"""The prompt: documents and chat messages -> a token layout with the role of every token.

``layout`` holds the data (:class:`Role`, :class:`Document`, :class:`Segment`, :class:`Turn`,
:class:`PromptLayout`); ``documents`` checks what callers pass; ``render`` tokenizes with the chat
template; ``chat`` finds the retrieved documents in framework messages; ``tokens`` keeps untrusted
text from ever becoming control tokens.
"""

from .layout import Document, DocumentLike, PromptLayout, Role, Segment, Turn

__all__ = ["Document", "DocumentLike", "PromptLayout", "Role", "Segment", "Turn"]
