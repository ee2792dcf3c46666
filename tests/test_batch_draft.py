"""Batched draft scoring: each row of a left-padded batch scores as it would alone."""

import pytest
import torch

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


def test_layer_prefix_draft_scores_one_by_one_with_errors_per_prompt(tokenizer, tiny_model):
    draft = LayerPrefixDraft(tiny_model, n_layers=1, pool_kernel=13, query_window=4)
    prompts = prompts_of(tokenizer, [15, 25])
    assert_rows_equal_single(draft, prompts)
    original = draft.score_prompt

    def fail_on_short(input_ids):
        if input_ids.numel() < 40:
            raise DraftScoringError("non-finite")
        return original(input_ids)

    draft.score_prompt = fail_on_short  # one prompt fails; the other still gets its scores
    first, second = draft.score_batch([prompts[0], torch.cat([prompts[1], prompts[1]])])
    assert isinstance(first, DraftScoringError) and isinstance(second, DraftScore)


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
