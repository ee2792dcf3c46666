"""Draft scoring against a reference built from eager attention weights (the paper's formula)."""

from contextlib import contextmanager

import pytest
import torch
import torch.nn.functional as F
from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from specprefill_rag.draft.hooks import capture_attention, decoder_layers, stop_after_layers
from specprefill_rag.draft.importance import ImportanceAccumulator, query_importance
from specprefill_rag.draft.model import LayerPrefixDraft, ModelDraft
from specprefill_rag.errors import DraftScoringError


def reference_importance(model, input_ids, look_ahead, pool_kernel, n_layers=None):
    """Importance from eager attention probabilities of the prompt + greedy look-ahead tokens.

    Softmax over the prompt keys only equals the full attention row restricted to the prompt and
    renormalised, which is what this computes from ``output_attentions``.
    """
    prompt_length = input_ids.numel()
    with torch.no_grad():
        full = (
            model.generate(input_ids[None], max_new_tokens=look_ahead - 1, do_sample=False)
            if look_ahead > 1
            else input_ids[None]
        )
        implementation = model.config._attn_implementation
        model.set_attn_implementation("eager")
        try:
            attentions = model(full, output_attentions=True).attentions
        finally:
            model.set_attn_implementation(implementation)
    attentions = attentions[:n_layers] if n_layers else attentions
    rows = torch.stack(
        [a[0, :, prompt_length - 1 : prompt_length - 1 + look_ahead, :prompt_length] for a in attentions]
    )
    rows = rows / rows.sum(-1, keepdim=True)  # [layers, H, N, L]
    pooled = F.avg_pool1d(rows.flatten(0, 2)[:, None], pool_kernel, 1, pool_kernel // 2).view(rows.shape)
    return pooled.amax(dim=(0, 1)).mean(0)


def prompt_ids(tokenizer, words=60):
    text = " ".join(["the bridge opened in 1883 after thirteen years of work"] * (words // 10))
    return torch.tensor(tokenizer(text)["input_ids"])


def test_query_importance_matches_naive_gqa():
    torch.manual_seed(0)
    query, keys = torch.randn(6, 8), torch.randn(2, 30, 8)
    got = query_importance(query, keys, 8**-0.5, pool_kernel=5)
    repeated = keys.repeat_interleave(3, dim=0)  # query head h reads KV head h // 3
    probs = torch.softmax((repeated @ query[:, :, None]).squeeze(-1) * 8**-0.5, dim=-1)
    pooled = F.avg_pool1d(probs[:, None], 5, 1, 2).squeeze(1)
    torch.testing.assert_close(got, pooled.amax(0))


def test_query_window_rows_see_only_earlier_keys():
    torch.manual_seed(0)
    window, keys = torch.randn(6, 3, 8), torch.randn(2, 30, 8)
    got = query_importance(window, keys, 8**-0.5, pool_kernel=5)
    repeated = keys.repeat_interleave(3, dim=0)
    for row in range(3):
        visible = 30 - 3 + row + 1  # row w is prompt token L - W + w: it sees keys up to itself
        probs = torch.softmax((repeated[:, :visible] @ window[:, row, :, None]).squeeze(-1) * 8**-0.5, dim=-1)
        padded = F.pad(probs, (0, 30 - visible))
        expected = F.avg_pool1d(padded[:, None], 5, 1, 2).squeeze(1).amax(0)
        torch.testing.assert_close(got[row], expected)


def test_accumulator_max_over_layers_mean_over_steps():
    accumulator = ImportanceAccumulator(3, n_steps=2)
    accumulator.add(torch.tensor([1.0, 0.0, 0.0]))
    accumulator.add(torch.tensor([0.0, 2.0, 0.0]))
    accumulator.step = 1
    accumulator.add(torch.tensor([3.0, 0.0, 4.0]))
    assert accumulator.result().tolist() == [2.0, 1.0, 2.0]


def test_accumulator_refuses_non_finite_scores_and_no_scores():
    accumulator = ImportanceAccumulator(3, n_steps=1)
    with pytest.raises(DraftScoringError, match="no draft attention"):
        accumulator.result()
    accumulator.add(torch.tensor([0.5, float("nan"), 0.1]))  # what an overflowing float16 draft head gives
    with pytest.raises(DraftScoringError, match="bfloat16 or float32"):
        accumulator.result()


@pytest.mark.parametrize("look_ahead", [1, 4])
def test_model_draft_matches_reference(tokenizer, tiny_model, look_ahead):
    input_ids = prompt_ids(tokenizer)
    draft = ModelDraft(tiny_model, look_ahead=look_ahead, pool_kernel=13, eos_token_ids=frozenset())
    got = draft.score(input_ids)
    assert got.shape == input_ids.shape
    torch.testing.assert_close(got, reference_importance(tiny_model, input_ids, look_ahead, 13), atol=1e-5, rtol=1e-4)


def test_layer_prefix_draft_uses_first_layers_only(tokenizer, tiny_model):
    input_ids = prompt_ids(tokenizer)
    got = LayerPrefixDraft(tiny_model, n_layers=1, pool_kernel=13).score(input_ids)
    torch.testing.assert_close(
        got, reference_importance(tiny_model, input_ids, 1, 13, n_layers=1), atol=1e-5, rtol=1e-4
    )
    assert not decoder_layers(tiny_model)[1]._forward_pre_hooks


def test_capture_attention_is_removed_even_on_error(tiny_model, tokenizer):
    before = tiny_model.config._attn_implementation
    accumulator = ImportanceAccumulator(4, 1)
    with pytest.raises(RuntimeError, match="boom"):
        with capture_attention(tiny_model, accumulator, 13) as name:
            assert tiny_model.config._attn_implementation == name
            assert name in ALL_ATTENTION_FUNCTIONS
            raise RuntimeError("boom")
    assert tiny_model.config._attn_implementation == before
    assert name not in ALL_ATTENTION_FUNCTIONS and name not in ALL_MASK_ATTENTION_FUNCTIONS
    assert all(m.config._attn_implementation == before for m in tiny_model.modules() if hasattr(m, "config"))


def test_stop_after_layers_hook_is_removed(tiny_model):
    layers = decoder_layers(tiny_model)
    with stop_after_layers(tiny_model, 1):
        assert layers[1]._forward_pre_hooks
    assert not layers[1]._forward_pre_hooks


def test_scoring_after_capture_leaves_model_outputs_unchanged(tokenizer, tiny_model):
    input_ids = prompt_ids(tokenizer)
    with torch.no_grad():
        before = tiny_model(input_ids[None]).logits
    ModelDraft(tiny_model, look_ahead=3).score(input_ids)
    with torch.no_grad():
        after = tiny_model(input_ids[None]).logits
    torch.testing.assert_close(before, after)


@contextmanager
def counting_forwards(model):
    """The list gains one entry per forward call of ``model`` (the draft's prefill, then one per look-ahead
    token it decodes) while the block runs.
    """
    calls: list[int] = []
    handle = model.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        yield calls
    finally:
        handle.remove()


def test_draft_stops_look_ahead_at_eos(tokenizer, tiny_model):
    input_ids = prompt_ids(tokenizer)
    with torch.no_grad():
        greedy = tiny_model.generate(input_ids[None], max_new_tokens=2, do_sample=False)[0, input_ids.numel() :]
    first, second = greedy.tolist()
    assert first != second, "an end-of-sequence at the second token must not also be one at the first"

    def score(look_ahead, eos=frozenset()):
        """The draft's importance and how many forward passes it ran."""
        with counting_forwards(tiny_model) as calls:
            importance = ModelDraft(tiny_model, look_ahead=look_ahead, eos_token_ids=eos).score(input_ids)
        return importance, len(calls)

    (one, one_steps), (two, two_steps), (four, four_steps) = score(1), score(2), score(4)
    assert (one_steps, two_steps, four_steps) == (1, 2, 4)
    assert not torch.allclose(four, one, rtol=1e-3, atol=1e-6), "the look-ahead queries must change the scores"
    at_first, first_steps = score(4, frozenset({first}))
    at_second, second_steps = score(4, frozenset({second}))
    assert (first_steps, second_steps) == (1, 2)
    torch.testing.assert_close(at_first, one)
    torch.testing.assert_close(at_second, two)


def test_layer_prefix_draft_query_window_matches_reference(tokenizer, tiny_model):
    input_ids = prompt_ids(tokenizer)
    window, length = 5, input_ids.numel()
    got = LayerPrefixDraft(tiny_model, n_layers=1, pool_kernel=13, query_window=window).score(input_ids)
    implementation = tiny_model.config._attn_implementation
    tiny_model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            attention = tiny_model(input_ids[None], output_attentions=True).attentions[0]  # layer 0 only
    finally:
        tiny_model.set_attn_implementation(implementation)
    rows = attention[0, :, length - window :, :length]  # [H, W, L], causal rows already sum to 1
    pooled = F.avg_pool1d(rows.flatten(0, 1)[:, None], 13, 1, 6).view(rows.shape)
    torch.testing.assert_close(got, pooled.amax(0).mean(0), atol=1e-5, rtol=1e-4)
