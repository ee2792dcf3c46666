"""Cached keys moved to another position equal the keys computed there (issue #28's first building block)."""

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from specprefill_rag.draft.rotation import rope_type, rotary_inv_freq, rotate_keys
from specprefill_rag.errors import DraftScoringError

SIZES = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 3}
HEADS = {"num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 4096}
LLAMA3 = {
    "rope_type": "llama3",
    "rope_theta": 500000.0,
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 256,
}


YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 16.0, "original_max_position_embeddings": 256}


def model_of(family: str):
    torch.manual_seed(0)
    if family == "qwen2":
        config = Qwen2Config(**SIZES, **HEADS, initializer_range=0.2)
        model = Qwen2ForCausalLM(config)
    else:
        extra = {"rope_parameters": {"llama3-scaled": LLAMA3, "yarn": YARN}[family]} if family != "llama" else {}
        model = LlamaForCausalLM(LlamaConfig(**SIZES, **HEADS, initializer_range=0.2, **extra))
    return model.float().eval()


def keys_at(model, ids: torch.Tensor, first: int) -> list[torch.Tensor]:
    """Every layer's cached keys ``[1, H_kv, T, d]`` of ``ids`` run at positions ``first, first + 1, ...``."""
    positions = torch.arange(first, first + ids.numel())[None]
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[None], position_ids=positions, past_key_values=cache, use_cache=True)
    return [layer.keys for layer in cache.layers]


@pytest.mark.parametrize("family", ["llama", "qwen2", "llama3-scaled", "yarn"])
@pytest.mark.parametrize(("a", "b"), [(0, 37), (300, 5), (12, 2000)])
def test_keys_rotated_from_a_to_b_equal_keys_computed_at_b(family, a, b):
    """Shifting a whole sequence leaves RoPE attention unchanged, so every layer's keys move by one rotation."""
    model = model_of(family)
    ids = torch.randint(0, 300, (24,), generator=torch.Generator().manual_seed(1))
    inv_freq = rotary_inv_freq(model)
    for cached, expected in zip(keys_at(model, ids, a), keys_at(model, ids, b)):
        # float32 angles near position 2000 round differently when composed: ~1e-4 on keys of norm ~10
        torch.testing.assert_close(rotate_keys(cached, b - a, inv_freq), expected, atol=5e-4, rtol=5e-4)


def test_yarn_scales_its_keys_and_the_rotation_keeps_the_scale():
    """YaRN multiplies cos and sin by an attention factor: cached keys carry it, and a rotation preserves norms."""
    model = model_of("yarn")
    assert model.model.rotary_emb.attention_scaling != 1.0
    keys = keys_at(model, torch.arange(10), 3)[0]
    moved = rotate_keys(keys, 100, rotary_inv_freq(model))
    torch.testing.assert_close(moved.norm(dim=-1), keys.norm(dim=-1), atol=1e-4, rtol=1e-4)


def test_the_scaled_variant_is_read_from_the_model():
    scaled, plain = rotary_inv_freq(model_of("llama3-scaled")), rotary_inv_freq(model_of("llama"))
    assert rope_type(model_of("llama3-scaled").config) == "llama3"
    assert not torch.allclose(scaled, plain)


def test_per_token_shifts_and_the_identity():
    keys = torch.randn(2, 5, 16)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 16, 2).float() / 16))
    torch.testing.assert_close(rotate_keys(keys, 0, inv_freq), keys)
    shifts = torch.tensor([0, 1, 2, 3, 4])
    one_by_one = torch.stack([rotate_keys(keys[:, t : t + 1], int(s), inv_freq)[:, 0] for t, s in enumerate(shifts)], 1)
    torch.testing.assert_close(rotate_keys(keys, shifts, inv_freq), one_by_one)
    there_and_back = rotate_keys(rotate_keys(keys, 900, inv_freq), -900, inv_freq)
    torch.testing.assert_close(there_and_back, keys, atol=1e-5, rtol=1e-5)


def test_partial_rotary_leaves_the_other_dims_alone():
    keys = torch.randn(1, 3, 16)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 8, 2).float() / 8))  # 8 of 16 dims rotated
    moved = rotate_keys(keys, 50, inv_freq)
    assert torch.equal(moved[..., 8:], keys[..., 8:]) and not torch.allclose(moved[..., :8], keys[..., :8])


def test_length_dependent_rope_is_refused():
    config = LlamaConfig(**SIZES, **HEADS, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4})
    with pytest.raises(DraftScoringError, match="draft_document_cache off"):
        rotary_inv_freq(LlamaForCausalLM(config))
