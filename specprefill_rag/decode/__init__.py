"""Decoding: from the main model's logits to the answer its caller receives.

For the backends: the next token (sampling, penalties, log-probabilities) and output constrained to a
JSON schema or to tool calls. For the engine and the gateway: text released once it is final, stop
strings, tool calls parsed out of the text, and the bookkeeping of one streamed request.
"""
