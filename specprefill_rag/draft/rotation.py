"""Moving cached keys to another position: RoPE rotations compose, so keys cached at position ``a`` become
the keys of position ``b`` by one more rotation of angle ``(b - a) * inv_freq``.

Transformers caches keys after RoPE (``k_a = s * R(a) k``, ``s`` the rotary embedding's attention scaling),
and ``R(b - a) R(a) = R(b)``: rotating a cached key gives the key computed at ``b`` exactly (to float
rounding), scaling included. Values carry no position. Scaled RoPE variants that only change
``inv_freq`` (linear, Llama 3, YaRN) are read from the model's rotary embedding; variants whose
frequencies depend on the sequence length (dynamic NTK, LongRoPE) cannot be moved and are refused.
Pure tensor code for the "rotate half" layout of Llama, Qwen2, Mistral and SmolLM2.
"""

from __future__ import annotations

from typing import Any

import torch

from ..errors import DraftScoringError

# RoPE variants whose frequencies are fixed once the model is built.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


def rope_type(config: Any) -> str:
    """The RoPE variant a transformers config declares (``default`` when it names none)."""
    parameters = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    return str(parameters.get("rope_type", parameters.get("type", "default")))


def rotary_inv_freq(model: Any) -> torch.Tensor:
    """``[R / 2]`` float32 inverse frequencies of a model's rotary embedding (``R`` rotated dims per head).

    Raises :class:`DraftScoringError` for a model without one, or whose frequencies depend on the length.
    """
    kind = rope_type(model.config)
    if kind not in STATIC_ROPE_TYPES:
        raise DraftScoringError(
            f"the draft's RoPE variant {kind!r} changes its frequencies with the sequence length, so cached keys "
            "cannot be moved to another position; turn draft_document_cache off for this draft"
        )
    for name, module in model.named_modules():
        if name.endswith("rotary_emb") and isinstance(getattr(module, "inv_freq", None), torch.Tensor):
            return module.inv_freq.detach().float()
    raise DraftScoringError(
        "the draft has no rotary embedding (rotary_emb.inv_freq), so its cached keys cannot be moved; turn "
        "draft_document_cache off for this draft"
    )


def rotate_keys(keys: torch.Tensor, shift: torch.Tensor | int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Keys cached at positions ``p`` -> the keys of positions ``p + shift``.

    Args:
        keys: ``[..., T, d]`` post-RoPE keys (``d`` head dims, the first ``2 * len(inv_freq)`` rotated).
        shift: positions to move by, an int or ``[T]`` long (one shift per token).
        inv_freq: ``[R / 2]`` float32, from :func:`rotary_inv_freq`.

    Returns:
        ``[..., T, d]`` in ``keys``' dtype; the rotation is computed in float32.
    """
    rotated = 2 * inv_freq.numel()
    shifts = torch.as_tensor(shift, device=keys.device).float().reshape(-1)
    angles = shifts[:, None] * inv_freq.to(keys.device)[None, :]  # [T or 1, R / 2]
    cos = torch.cat([angles.cos(), angles.cos()], dim=-1)
    sin = torch.cat([angles.sin(), angles.sin()], dim=-1)
    part = keys[..., :rotated].float()
    half = rotated // 2
    turned = torch.cat([-part[..., half:], part[..., :half]], dim=-1)
    moved = (part * cos + turned * sin).to(keys.dtype)
    return torch.cat([moved, keys[..., rotated:]], dim=-1) if rotated < keys.shape[-1] else moved
