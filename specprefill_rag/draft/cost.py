"""The prompt length from which a draft pays for itself: below it, drafting costs more time to first
token than the smaller prefill saves, so the prompt is prefilled whole (``min_prompt_tokens="auto"``).

In units of one main-model prompt token, SpecPrefill saves ``1 - keep`` of the prefill per prompt token
and spends ``r`` on the draft, where ``r`` is the draft's cost against the main model's (its parameters'
share, or its share of the main model's layers for ``draft="self"``; a draft run to its first
``draft_layers`` counts the parameters it runs: :func:`draft_parameter_count`). It also pays a fixed cost ``F``,
mostly the look-ahead steps: each reads all of the draft's weights whatever the prompt length. So it pays
from ``F / (1 - keep - r)`` prompt tokens, and never when ``r >= 1 - keep``.

``F = 128 + 256 * (look_ahead - 1) / 7`` main-model tokens, fitted on the 2-core CPU crossovers at keep
0.3 (docs: "When SpecPrefill pays"): it puts ``self`` (12 of 30 or 11 of 28 layers, ``r = 0.4``) at 448
tokens (measured 340-470), the 0.5B sibling drafting for Qwen2.5-Coder-1.5B (``r = 0.32``, look-ahead 8)
at 1,024 (measured ~1,000) and SmolLM2-135M drafting for it (``r = 0.09``) at 640 (measured ~470).
"""

from __future__ import annotations

import math

from torch import nn

from .hooks import decoder_layers

MEASURED_KEEP_RATE = 0.3  # the keep rate of the crossover runs the fit is read from
FIXED_COST_TOKENS = 128.0  # F for a draft without look-ahead steps ('self')
LOOK_AHEAD_COST_TOKENS = 256.0 / 7  # F per look-ahead step of a separate draft
ROUND_TO = 64
# A main model on vLLM runs elsewhere (its size and device are not known here): the crossover of the
# slowest measured pair, which makes no request of a measured pair slower.
REMOTE_MAIN_MIN_PROMPT_TOKENS = 1024


def parameter_count(model: nn.Module) -> int:
    """Parameters of ``model``, each shared tensor once (tied embeddings)."""
    return sum(p.numel() for p in {id(p): p for p in model.parameters()}.values())


def draft_parameter_count(model: nn.Module, layers: int | None = None) -> int:
    """Parameters of a draft that runs its first ``layers`` decoder layers (None: all): :func:`parameter_count`
    without those of the layers after them. The embeddings stay counted, as they are for a whole draft (the fit
    above is read with them), which errs towards a higher floor.
    """
    if layers is None:
        return parameter_count(model)
    skipped = decoder_layers(model)[layers:]
    return parameter_count(model) - sum(p.numel() for p in {id(p): p for p in skipped.parameters()}.values())


def pays_from(draft_share: float, look_ahead: int) -> int | None:
    """The prompt length (rounded up to a multiple of 64) from which a draft costing ``draft_share`` of the
    main model per token, with ``look_ahead`` query steps, saves time at keep 0.3; None when it never does.
    """
    margin = 1.0 - MEASURED_KEEP_RATE - draft_share
    if margin <= 0:
        return None
    fixed = FIXED_COST_TOKENS + LOOK_AHEAD_COST_TOKENS * (look_ahead - 1)
    return ROUND_TO * math.ceil(fixed / margin / ROUND_TO)
