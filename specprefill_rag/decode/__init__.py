"""Decoding: next-token choice (``sampling``), text released as it becomes final (``detokenize``) and
the bookkeeping of one streamed request (``stream``).
"""
