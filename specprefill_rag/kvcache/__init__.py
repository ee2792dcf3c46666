"""Key/value stores that serve both models: the prefix KV cache and the block-hash index that finds prefixes.

The draft starts a prompt from its cached prefix, the in-process main model from the KV of an earlier
request, and the selection memo finds earlier turns with the index. A leaf below ``draft/``,
``backends/`` and ``selection/``: it imports none of them.
"""
