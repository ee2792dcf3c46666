"""The prompt: documents and chat messages -> a token layout with the role of every token.

Every later step reads the roles: only document tokens may be dropped. Documents are found however
callers pass them (arguments, framework messages, context inside a system message); untrusted text is
tokenized as text, so it never yields control tokens; tools and tool calls are checked before rendering.
"""

from .layout import Document, DocumentLike, PromptLayout, Role, Segment, Turn

__all__ = ["Document", "DocumentLike", "PromptLayout", "Role", "Segment", "Turn"]
