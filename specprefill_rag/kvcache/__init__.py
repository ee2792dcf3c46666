"""Key/value stores that serve both models: the prefix KV cache (the draft's prompts, and the main model's in
process) and the block-hash index it and the selection memo find prefixes with. A leaf below ``draft/``,
``backends/`` and ``selection/``: it imports none of them.
"""
