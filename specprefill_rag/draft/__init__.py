"""The draft: which prompt tokens matter, from a small model's attention (paper section 3).

``model`` holds the drafts (a separate model or the main model's first layers) and ``batch`` scores
several prompts in one forward; ``hooks`` captures their attention and ``importance`` folds it into one
score per token; ``paths`` runs a layout through the direct, mapped or self path, with ``mapping`` for a
draft of another vocabulary and ``budget`` for its memory. The prefix KV cache the draft reuses a prompt's
known prefix from lives in :mod:`specprefill_rag.kvcache` (the main model uses it too).
"""
