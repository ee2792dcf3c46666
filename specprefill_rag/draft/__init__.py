"""The draft: which prompt tokens matter, from a small model's attention (paper section 3).

A draft (a separate small model, or the main model's first layers) reads the prompt and a few queries
after it: look-ahead tokens it decodes, or the prompt's last tokens. Their attention onto the prompt,
captured layer by layer without an ``L x L`` matrix, becomes one importance per prompt token, on the main
model's tokens even when the draft has another vocabulary. Its caches (documents drafted once each, here;
a scored prompt's prefix, in :mod:`specprefill_rag.kvcache`) make prompts over known documents cheap
to score again. The module map is in the docs (Design, How it works).
"""
