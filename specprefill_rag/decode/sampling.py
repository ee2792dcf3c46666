"""Next-token choice from logits: greedy, temperature and nucleus (top-p) sampling; and what the logits
say about the chosen token (its log-probability and the most likely alternatives).
"""

from __future__ import annotations

import torch

from ..results import StepLogprobs


def apply_penalties(logits: torch.Tensor, counts: torch.Tensor, presence: float, frequency: float) -> torch.Tensor:
    """OpenAI's presence and frequency penalties: ``[V]`` logits less ``presence`` for every token generated
    so far and ``frequency`` per time it was.

    Args:
        logits: ``[V]`` scores of the next token.
        counts: ``[V]`` how often each token was generated so far.
    """
    if presence == 0.0 and frequency == 0.0:
        return logits
    return logits - (presence * (counts > 0) + frequency * counts).to(logits.dtype)


def next_token(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator | None) -> int:
    """Pick one token.

    Args:
        logits: ``[V]`` scores of the next token.
        temperature: 0 means greedy (argmax).
        top_p: keep the smallest set of tokens whose probability reaches ``top_p``.
        generator: random source for reproducible sampling, or None.
    """
    if temperature == 0.0:
        return int(logits.argmax())
    probs = torch.softmax(logits.float() / temperature, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = torch.sort(probs, descending=True)
        outside = torch.cumsum(sorted_probs, 0) - sorted_probs >= top_p
        outside[0] = False  # the most likely token always stays: a top_p below float32's resolution (1e-300) is greedy
        sorted_probs[outside] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return int(torch.multinomial(probs, 1, generator=generator))


def log_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """``[V]`` raw logits -> ``[V]`` float32 log-probabilities over the whole vocabulary (a new tensor: take them
    before temperature, top-p, penalties or a constraint change the logits).
    """
    return torch.log_softmax(logits.float(), dim=-1)


def step_logprobs(logprobs: torch.Tensor, token: int, top: int) -> StepLogprobs:
    """From ``[V]`` log-probabilities: ``token``'s, and the ``top`` most likely tokens' (most likely first)."""
    values, ids = torch.topk(logprobs, top) if top else (logprobs[:0], logprobs[:0].long())
    return StepLogprobs(token, float(logprobs[token]), tuple(ids.tolist()), tuple(values.tolist()))
