"""Batched draft scoring: each row of a left-padded batch scores as it would alone."""

import copy

import pytest
import torch

from specprefill_rag.draft.hooks import decoder_layers
from specprefill_rag.draft.importance import DraftScore
from specprefill_rag.draft.model import LayerPrefixDraft, ModelDraft
from specprefill_rag.errors import DraftScoringError
from specprefill_rag.kvcache.prefix_cache import PrefixKVCache
from specprefill_rag.testing import random_documents


def prompts_of(tokenizer, word_counts):
    return [torch.tensor(tokenizer(" ".join(random_documents(2, n, seed=n)))["input_ids"]) for n in word_counts]


def assert_rows_equal_single(draft, prompts):
    batched = draft.score_batch(prompts)
    assert len(batched) == len(prompts)
    for prompt, row in zip(prompts, batched):
        assert isinstance(row, DraftScore) and row.importance.shape == prompt.shape
        torch.testing.assert_close(row.importance, draft.score(prompt), rtol=1e-5, atol=1e-7)
    return batched


@pytest.mark.parametrize("look_ahead", [1, 4])
def test_rows_of_different_lengths_equal_their_single_scores(tokenizer, tiny_model, look_ahead):
    draft = ModelDraft(tiny_model, look_ahead=look_ahead, pool_kernel=13)
    assert_rows_equal_single(draft, prompts_of(tokenizer, [20, 70, 45]))


def test_a_row_that_reaches_eos_stops_alone(tokenizer, tiny_model):
    prompts = prompts_of(tokenizer, [30, 60])
    with torch.no_grad():
        first = [int(tiny_model(p[None]).logits[0, -1].argmax()) for p in prompts]
    assert first[0] != first[1], "the rows must differ in their first look-ahead token for this check"
    draft = ModelDraft(tiny_model, look_ahead=4, eos_token_ids=frozenset({first[0]}))
    assert_rows_equal_single(draft, prompts)
    stopped = ModelDraft(tiny_model, look_ahead=1).score(prompts[0])
    torch.testing.assert_close(draft.score_batch(prompts)[0].importance, stopped)


def test_batch_scoring_restores_the_attention_implementation(tokenizer, tiny_model):
    before = tiny_model.config._attn_implementation
    ModelDraft(tiny_model, look_ahead=2).score_batch(prompts_of(tokenizer, [10, 20]))
    assert all(m.config._attn_implementation == before for m in tiny_model.modules() if hasattr(m, "config"))


@pytest.mark.parametrize(
    ("n_layers", "window"),
    [(1, 4), (2, 16), (2, 1)],  # a truncated draft; the whole tiny draft with the default window; one query
)
def test_window_rows_of_different_lengths_equal_their_single_scores(tokenizer, tiny_model, n_layers, window):
    """A draft scoring with a window batches too (issue #44: the window is the default for a separate draft, and the
    gateway batches drafts on a GPU): each row's last min(W, L_b) columns are its queries."""
    draft = LayerPrefixDraft(tiny_model, n_layers=n_layers, pool_kernel=13, query_window=window)
    short = torch.tensor(tokenizer("Why?")["input_ids"])  # fewer tokens than the window of 16
    assert_rows_equal_single(draft, [*prompts_of(tokenizer, [15, 60, 35]), short])


def test_a_window_batch_is_one_forward(tokenizer, tiny_model):
    draft = LayerPrefixDraft(tiny_model, n_layers=1, pool_kernel=13, query_window=4)
    calls = []
    handle = decoder_layers(tiny_model)[0].register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        draft.score_batch(prompts_of(tokenizer, [15, 25, 40]))
    finally:
        handle.remove()
    assert len(calls) == 1


def test_a_window_row_that_fails_fails_alone(tokenizer, tiny_model):
    """A row whose scores are not finite gets its own error; the other rows of its batch are scored."""
    broken = copy.deepcopy(tiny_model)
    clean, poisoned = prompts_of(tokenizer, [20, 30])
    token = int(poisoned[3])
    assert token not in clean.tolist(), "the poisoned token must appear in one prompt only for this check"
    with torch.no_grad():
        broken.get_input_embeddings().weight[token] = float("nan")
    draft = LayerPrefixDraft(broken, n_layers=2, pool_kernel=13, query_window=4)
    first, second = draft.score_batch([clean, poisoned])
    assert isinstance(second, DraftScoringError) and isinstance(first, DraftScore)
    torch.testing.assert_close(first.importance, draft.score(clean), rtol=1e-5, atol=1e-7)


def test_window_prompts_the_prefix_cache_serves_are_scored_alone_from_it(tokenizer, tiny_model):
    cache = PrefixKVCache(max_bytes=1 << 26)
    draft = LayerPrefixDraft(tiny_model, n_layers=2, pool_kernel=13, query_window=4, prefix_cache=cache)
    documents, others = prompts_of(tokenizer, [60, 35])
    draft.score(documents)  # cached: the documents of an earlier question
    follow_up = torch.cat([documents, torch.tensor(tokenizer(" When did it open?")["input_ids"])])
    cold = LayerPrefixDraft(tiny_model, n_layers=2, pool_kernel=13, query_window=4)
    rows = draft.score_batch([others, follow_up, others.flip(0)])
    assert [row.cached_tokens for row in rows] == [0, documents.numel(), 0]  # its window: the new question
    for prompt, row in zip([others, follow_up, others.flip(0)], rows):
        torch.testing.assert_close(row.importance, cold.score(prompt), rtol=1e-4, atol=1e-6)


def test_prompts_the_prefix_cache_serves_are_scored_alone_from_it(tokenizer, tiny_model):
    cache = PrefixKVCache(max_bytes=1 << 26)
    draft = ModelDraft(tiny_model, look_ahead=2, pool_kernel=13, prefix_cache=cache)
    documents, others = prompts_of(tokenizer, [60, 35])
    draft.score(documents)  # cached: the documents of an earlier question
    follow_up = torch.cat([documents, torch.tensor(tokenizer(" When did it open?")["input_ids"])])
    cold = ModelDraft(tiny_model, look_ahead=2, pool_kernel=13)
    rows = draft.score_batch([others, follow_up, others.flip(0)])
    assert [row.cached_tokens for row in rows] == [0, documents.numel(), 0]
    for prompt, row in zip([others, follow_up, others.flip(0)], rows):
        torch.testing.assert_close(row.importance, cold.score(prompt), rtol=1e-4, atol=1e-6)


@pytest.mark.real_model
def test_rows_equal_single_scores_on_smollm2():
    from specprefill_rag.backends.hf import eos_token_ids
    from specprefill_rag.models.loading import shared_model

    loaded = shared_model("smollm2-135m", dtype="float32")  # bfloat16 rounds padded rows differently
    draft = ModelDraft(
        loaded.model, look_ahead=8, pool_kernel=13, eos_token_ids=eos_token_ids(loaded.model, loaded.tokenizer)
    )
    texts = [
        "The Brooklyn Bridge opened in 1883. " * 12 + "When did it open?",
        "Apollo 11 landed in 1969. " * 30 + "When?",
    ]
    prompts = [torch.tensor(loaded.tokenizer(t)["input_ids"]) for t in texts]
    assert prompts[0].numel() != prompts[1].numel()
    assert_rows_equal_single(draft, prompts)
