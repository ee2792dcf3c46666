"""Attention of a few draft queries onto the prompt -> one importance per prompt token.

Pure tensor code (paper section 3.2): per layer and head, ``softmax(q . K^T * scale)`` over the
prompt keys only, in float32; average pooling along the prompt; max over layers x heads; mean
over the look-ahead queries. Memory is ``O(heads x L)`` per call: scores are reduced layer by
layer into a running max, and no ``L x L`` matrix exists.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from ..errors import DraftScoringError


def query_importance(query: torch.Tensor, keys: torch.Tensor, scaling: float, pool_kernel: int) -> torch.Tensor:
    """Importance of every prompt token for one query token, or for a window of them, in one layer.

    Args:
        query: ``[H, d]`` post-RoPE query of one token that sees every prompt key (the last prompt
            token or a look-ahead token), or ``[H, W, d]``: the last ``W`` prompt tokens, row ``w``
            seeing keys ``0 .. L - W + w`` only (causal).
        keys: ``[H_kv, L, d]`` post-RoPE keys of the prompt; ``H`` must be a multiple of ``H_kv``
            (grouped-query attention: query head ``h`` reads KV head ``h // (H / H_kv)``).
        scaling: softmax scale, usually ``d ** -0.5``.
        pool_kernel: odd average-pooling kernel along the prompt (zero padded, as the paper's code).

    Returns:
        ``[L]`` float32 (or ``[W, L]`` for a window): max over heads of the pooled attention probabilities.
    """
    if query.dim() == 2:
        return query_importance(query[:, None], keys, scaling, pool_kernel)[0]
    n_heads, window, n_kv_heads, length = query.shape[0], query.shape[1], keys.shape[0], keys.shape[1]
    group = n_heads // n_kv_heads
    grouped_query = query.float().reshape(n_kv_heads, group * window, -1)
    logits = torch.matmul(grouped_query, keys.float().transpose(1, 2)) * scaling  # [H_kv, group * W, L]
    logits = logits.view(n_kv_heads, group, window, length)
    if window > 1:
        rows = torch.arange(window, device=keys.device)[:, None] + (length - window)
        logits = logits.masked_fill(torch.arange(length, device=keys.device)[None, :] > rows, float("-inf"))
    probs = torch.softmax(logits, dim=-1).reshape(n_heads * window, 1, length)
    if pool_kernel > 1:
        probs = F.avg_pool1d(probs, kernel_size=pool_kernel, stride=1, padding=pool_kernel // 2)
    return probs.view(n_heads, window, length).amax(dim=0)


class ImportanceAccumulator:
    """Running ``max over layers x heads`` per look-ahead step, then ``mean over steps``.

    Args:
        prompt_length: ``L``.
        n_steps: number of query tokens (look-ahead ``N``).
    """

    def __init__(self, prompt_length: int, n_steps: int, device: torch.device | str = "cpu") -> None:
        self.prompt_length = prompt_length
        self.scores = torch.zeros(n_steps, prompt_length, dtype=torch.float32, device=device)
        self.seen = torch.zeros(n_steps, dtype=torch.bool)
        self.step = 0

    def add(self, layer_importance: torch.Tensor) -> None:
        """Fold one layer's ``[L]`` importance into the current step."""
        layer_importance = layer_importance.to(self.scores.device)  # a draft split over GPUs: layer k's device
        torch.maximum(self.scores[self.step], layer_importance, out=self.scores[self.step])
        self.seen[self.step] = True

    def add_window(self, window_importance: torch.Tensor) -> None:
        """Fold one layer's ``[W, L]`` importance of a query window into steps ``0 .. W-1``."""
        rows = window_importance.shape[0]
        window_importance = window_importance.to(self.scores.device)
        torch.maximum(self.scores[:rows], window_importance, out=self.scores[:rows])
        self.seen[:rows] = True

    def result(self) -> torch.Tensor:
        """``[L]`` float32 mean over the steps that saw at least one layer."""
        if not bool(self.seen.any()):
            raise DraftScoringError("no draft attention was captured; the draft model's attention did not run")
        importance = self.scores[self.seen.to(self.scores.device)].mean(dim=0)
        if not bool(torch.isfinite(importance).all()):
            # Selection would otherwise rank NaN chunks arbitrarily and keep the wrong documents.
            raise DraftScoringError(
                "the draft model produced non-finite attention scores (float16 overflow is the usual cause); "
                "load the draft in bfloat16 or float32 (dtype='bfloat16')"
            )
        return importance


@dataclass(frozen=True)
class DraftScore:
    """What a draft computed for one prompt.

    Attributes:
        importance: ``[L]`` float32 importance of each prompt token.
        cached_tokens: leading prompt tokens whose draft KV came from the prefix cache (0 on a miss).
        document_cached_tokens: prompt tokens whose draft KV came from the per-document cache.
        documents_cached: documents whose draft KV came from it.
    """

    importance: torch.Tensor
    cached_tokens: int = 0
    document_cached_tokens: int = 0
    documents_cached: int = 0
