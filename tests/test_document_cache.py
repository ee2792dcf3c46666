"""Per-document draft KV (issue #28): documents drafted once, their keys rotated to where they sit now."""

from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from transformers import DynamicCache

from specprefill_rag.config import GenerationParams
from specprefill_rag.draft.document_cache import DocumentKVCache, assemble_prompt_kv
from specprefill_rag.draft.model import ModelDraft
from specprefill_rag.draft.paths import draft_score
from specprefill_rag.draft.prefix_cache import DraftIdentity
from specprefill_rag.engine import SpecPrefillEngine
from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.prompt.layout import document_runs
from specprefill_rag.testing import build_model, random_documents


@pytest.fixture(scope="module")
def sharp_draft(tokenizer):
    return build_model(tokenizer, layers=2, seed=3, initializer_range=0.2)


def identity(model):
    return DraftIdentity.of(model, model.config.num_hidden_layers)


def joint_kv(model, ids):
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        model(input_ids=ids[None], position_ids=torch.arange(ids.numel())[None], past_key_values=cache, use_cache=True)
    return cache


def layout_of(engine, documents, question="When did the bridge open?"):
    return engine.layout(question, documents)


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer, sharp_draft):
    return SpecPrefillEngine.from_models(tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=3)


def test_one_document_assembles_the_joint_kv(engine, sharp_draft):
    layout = layout_of(engine, random_documents(1, 60, seed=1))
    ids, spans = layout.input_ids, document_runs(layout.document_index)
    assembled = assemble_prompt_kv(sharp_draft, identity(sharp_draft), ids, spans, DocumentKVCache(2**24))
    joint = joint_kv(sharp_draft, ids[:-1])
    assert assembled.documents_cached == 0 and assembled.cached_tokens == int(spans[0, 1] - spans[0, 0])
    for mine, theirs in zip(assembled.past.layers, joint.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)


def test_scores_with_the_cache_equal_joint_scores_for_one_document(engine, sharp_draft, tokenizer):
    layout = layout_of(engine, random_documents(1, 80, seed=2))
    store = DocumentKVCache(2**24)
    draft = ModelDraft(sharp_draft, 3, 13, frozenset(), document_cache=store)
    spans = document_runs(layout.document_index)
    joint = draft.score_prompt(layout.input_ids)
    for _ in range(2):  # a miss (encoded now), then a hit
        cached = draft.score_prompt(layout.input_ids, spans)
        torch.testing.assert_close(cached.importance, joint.importance, atol=1e-5, rtol=1e-4)
    assert cached.documents_cached == 1 and cached.document_cached_tokens == int(spans[0, 1] - spans[0, 0])


def test_documents_in_another_order_come_from_the_cache(engine, sharp_draft):
    documents = random_documents(3, 50, seed=3)
    store = DocumentKVCache(2**24)
    draft = ModelDraft(sharp_draft, 3, 13, frozenset(), document_cache=store)
    first = layout_of(engine, documents)
    cold = draft.score_prompt(first.input_ids, document_runs(first.document_index))
    assert cold.documents_cached == 0 and len(store) == 3
    swapped = layout_of(engine, [documents[2], documents[0]], question="Who built it?")
    warm = draft.score_prompt(swapped.input_ids, document_runs(swapped.document_index))
    assert warm.documents_cached == 2 and warm.document_cached_tokens == swapped.n_document_tokens
    assert warm.importance.shape == (len(swapped),) and bool(torch.isfinite(warm.importance).all())


def test_the_cache_stays_within_its_bytes_and_drops_the_oldest(engine, sharp_draft):
    one = 2 * sharp_draft.config.num_hidden_layers * 2 * 16 * 4  # keys + values, layers, KV heads, head dim, fp32
    documents = random_documents(4, 40, seed=4)
    store = DocumentKVCache(int(one * 60 * 2.5))  # about two documents of ~60 tokens
    draft = ModelDraft(sharp_draft, 2, 13, frozenset(), document_cache=store)
    for document in documents:
        layout = layout_of(engine, [document])
        draft.score_prompt(layout.input_ids, document_runs(layout.document_index))
        assert store.nbytes <= store.max_bytes
    assert 1 <= len(store) < len(documents)
    store.clear()
    assert len(store) == 0 and store.nbytes == 0


@pytest.mark.parametrize(
    "spans", [[[0, 5]], [[5, 9], [7, 12]], [[5, 4]], [[3, 10_000]]], ids=["no-prefix", "overlap", "empty", "past-end"]
)
def test_bad_spans_are_refused(engine, sharp_draft, spans):
    layout = layout_of(engine, random_documents(1, 30))
    with pytest.raises(InvalidRequestError, match="document spans"):
        assemble_prompt_kv(
            sharp_draft, identity(sharp_draft), layout.input_ids, torch.tensor(spans), DocumentKVCache(2**20)
        )


def test_the_engine_setting_reports_what_the_cache_served(tiny_model, tokenizer, sharp_draft):
    engine = SpecPrefillEngine.from_models(
        tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=2, draft_document_cache=True, reselect=True
    )
    documents = random_documents(2, 64, seed=5)
    params = GenerationParams(max_new_tokens=2)
    engine.generate_layout(layout_of(engine, documents), params)
    swapped = layout_of(engine, documents[::-1], question="Why?")
    stats = engine.generate_layout(swapped, params).stats
    assert stats.draft_documents_cached == 2 and stats.draft_document_cached_tokens == swapped.n_document_tokens
    off = SpecPrefillEngine.from_models(tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=2)
    assert off.generate_layout(swapped, params).stats.draft_documents_cached == 0


def test_concurrent_scoring_equals_sequential(engine, sharp_draft):
    documents = random_documents(4, 40, seed=6)
    layouts = [layout_of(engine, [documents[i], documents[(i + 1) % 4]]) for i in range(4)] * 2
    draft = ModelDraft(sharp_draft, 2, 13, frozenset(), document_cache=DocumentKVCache(2**24))
    expected = [draft.score_prompt(x.input_ids, document_runs(x.document_index)).importance for x in layouts]
    fresh = ModelDraft(sharp_draft, 2, 13, frozenset(), document_cache=DocumentKVCache(2**24))

    def score(layout):  # as the engine scores: under the draft model's lock (draft_score)
        return draft_score(fresh, layout.input_ids, document_runs(layout.document_index)).importance

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(score, layouts, timeout=120))
    for got, want in zip(results, expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)
