"""Which cached document tokens to compute again in context, so per-document draft KV scores like joint KV.

A document's cached KV was computed after the prefix alone: it never attended to the documents before it
in this prompt. Three choices, by measurement (benchmarks/results/document_cache/README.md):

``naive``  every document token from the cache.
``epic``   each document's first ``first_tokens`` tokens computed in context (EPIC, Hu et al. 2024: the
           tokens right after a boundary carry most of the attention sink a lone encoding gives them).
``blend``  the ``share`` of document tokens whose cached KV deviates most from their KV in context,
           judged on the first ``probe_layers`` layers run jointly over the prompt (CacheBlend, Yao et al.
           2025: KV deviation at an early layer predicts it at later ones); those layers' joint KV is then
           used whole, and the chosen tokens are computed in context through every layer.
``query``  the ``share`` of document tokens the question attends to most over the assembled cached KV
           (ProphetKV, 2026: KV deviation is crowded out by globally salient tokens; what the question reads is
           what its answer needs), then computed in context through every layer. Not yet measured on the real
           pair (docs: Document cache). How the attention is read without another full pass: :mod:`.assembly`.

Pure tensor code: spans, deviations and attention in, sorted positions out.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..config import (
    DEFAULT_BLEND_SHARE,
    SHARED_REPAIRS,
    CompressionSettings,
    DocumentFirstSight,
    DocumentRepairKind,
)
from ..errors import InvalidRequestError


@dataclass(frozen=True)
class DocumentRepair:
    """How much of each cached document the draft computes again in context.

    Attributes:
        kind: ``naive``, ``epic``, ``blend`` or ``query`` (see the module).
        first_tokens: ``epic``: tokens at the start of each document computed in context.
        share: ``blend``, ``query``: share of the prompt's cached document tokens computed in context.
        probe_layers: ``blend``: leading layers run jointly over the prompt to find the deviating tokens.
        first_sight: how a document the store does not hold is drafted: ``alone`` (encoded alone after the prefix,
            stored, then assembled as a hit) or ``in_context`` (computed in the pass that scores the prompt, then
            stored from it; the repair then covers the documents the store held): :mod:`.assembly`.
    """

    kind: DocumentRepairKind = "blend"
    first_tokens: int = 16
    share: float = DEFAULT_BLEND_SHARE
    probe_layers: int = 2
    first_sight: DocumentFirstSight = "alone"

    def __post_init__(self) -> None:
        if self.kind not in ("naive", "epic", *SHARED_REPAIRS):
            raise InvalidRequestError(f"document repair must be 'naive', 'epic', 'blend' or 'query', not {self.kind!r}")
        if self.first_sight not in ("alone", "in_context"):
            raise InvalidRequestError(
                f"a document's first sight must be 'alone' or 'in_context', not {self.first_sight!r}"
            )
        if self.first_tokens < 0 or not 0.0 <= self.share <= 1.0 or self.probe_layers < 1:
            raise InvalidRequestError(
                "document repair needs first_tokens >= 0, 0 <= share <= 1 and probe_layers >= 1, not "
                f"{self.first_tokens}, {self.share}, {self.probe_layers}"
            )

    @classmethod
    def of(cls, settings: CompressionSettings) -> DocumentRepair:
        """The repair ``settings`` ask for (``document_repair``; for blend and query, ``document_repair_share``; and
        ``document_first_sight``).
        """
        return cls(
            settings.document_repair,
            share=settings.document_repair_share,
            first_sight=settings.document_first_sight,
        )


NAIVE = DocumentRepair("naive")
EPIC = DocumentRepair("epic")
BLEND = DocumentRepair("blend")
QUERY = DocumentRepair("query")
DEFAULT_REPAIR = BLEND  # chosen by measurement: benchmarks/results/document_cache/README.md


def first_tokens_of(spans: torch.Tensor, count: int) -> torch.Tensor:
    """``[R]`` sorted positions: the first ``count`` tokens of each ``[S, 2]`` document span."""
    pieces = [torch.arange(start, min(start + count, end)) for start, end in spans.tolist()]
    return torch.cat(pieces) if pieces else torch.zeros(0, dtype=torch.long)


def recompute_count(tokens: int, share: float) -> int:
    """How many of ``tokens`` cached document tokens a repair of ``share`` computes again: ``ceil(share * tokens)``."""
    return min(math.ceil(share * tokens - 1e-9), tokens)


def most_deviating(positions: torch.Tensor, deviation: torch.Tensor, share: float) -> torch.Tensor:
    """``[R]`` sorted: the :func:`recompute_count` of the ``[T]`` cached ``positions`` with the largest ``[T]``
    deviation (or, for ``query``, attention).
    """
    count = recompute_count(positions.numel(), share)
    if count == 0:
        return torch.zeros(0, dtype=torch.long)
    chosen = torch.topk(deviation.float(), count).indices
    return positions[chosen].sort().values


most_attended = most_deviating  # the same choice, read over the question's attention


def question_attention(query: torch.Tensor, keys: torch.Tensor, visible: torch.Tensor, scaling: float) -> torch.Tensor:
    """``[Q, K]`` float32 attention of ``Q`` question rows onto ``K`` keys in one layer, max over heads.

    Args:
        query: ``[H, Q, d]`` post-RoPE queries; keys: ``[H_kv, K, d]`` post-RoPE keys (any slot order); ``H`` a
            multiple of ``H_kv`` (grouped-query attention: query head ``h`` reads KV head ``h // (H / H_kv)``).
        visible: ``[Q, K]`` bool, which keys each row sees (its causal mask).
        scaling: the softmax scale.
    """
    n_heads, rows, n_kv_heads = query.shape[0], query.shape[1], keys.shape[0]
    grouped = query.float().reshape(n_kv_heads, (n_heads // n_kv_heads) * rows, -1)
    logits = torch.matmul(grouped, keys.float().transpose(1, 2)) * scaling  # [H_kv, group * Q, K]
    logits = logits.view(n_kv_heads, -1, rows, keys.shape[1]).masked_fill(~visible, float("-inf"))
    return torch.softmax(logits, dim=-1).amax(dim=(0, 1))


def kv_deviation(cached: tuple[torch.Tensor, torch.Tensor], joint: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """``[T]`` float32 squared distance between cached and joint keys and values of one layer, per token.

    Args:
        cached, joint: keys and values ``[1, H_kv, T, d]`` (the cached keys already moved to their positions).
    """
    keys = (cached[0].float() - joint[0].float()).pow(2).sum(dim=(0, 1, 3))
    values = (cached[1].float() - joint[1].float()).pow(2).sum(dim=(0, 1, 3))
    return keys + values
