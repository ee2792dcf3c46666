"""A document's first sight in the draft (issue #44 part 3, ``document_first_sight="in_context"``): documents the
store does not hold are computed in the pass that scores the prompt and stored from it, so a miss costs what a cold
draft does and a partial hit the tokens not held. Costs are counted in tokens through the draft, not timed."""

import math

import pytest
import torch
from pydantic import ValidationError

from specprefill_rag.config import GenerationParams, SpecPrefillConfig
from specprefill_rag.draft import assembly
from specprefill_rag.draft.assembly import DocumentSpans, assemble_prompt_kv
from specprefill_rag.draft.document_cache import DocumentKVCache
from specprefill_rag.draft.model import LayerPrefixDraft, ModelDraft
from specprefill_rag.draft.repair import DocumentRepair
from specprefill_rag.engine import SpecPrefillEngine
from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.kvcache.prefix_cache import DraftIdentity
from specprefill_rag.prompt.layout import document_runs
from specprefill_rag.testing import build_model, random_documents

IN_CONTEXT = DocumentRepair("naive", first_sight="in_context")


@pytest.fixture(scope="module")
def sharp_draft(tokenizer):
    return build_model(tokenizer, layers=2, seed=3, initializer_range=0.2)


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer, sharp_draft):
    return SpecPrefillEngine.from_models(tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=2)


@pytest.fixture
def forwarded(monkeypatch):
    """Tokens of each forward pass the assembly runs, in order."""
    calls, original = [], assembly._forward

    def counted(model, layers, token_ids, positions, past):
        calls.append(token_ids.numel())
        return original(model, layers, token_ids, positions, past)

    monkeypatch.setattr(assembly, "_forward", counted)
    return calls


def prompt(engine, documents):
    layout = engine.layout("When did the bridge open?", documents)
    return layout.input_ids, DocumentSpans(document_runs(layout.document_index))


def identity(model):
    return DraftIdentity.of(model, model.config.num_hidden_layers)


@pytest.mark.parametrize("kind", ["naive", "blend", "query"])
def test_a_miss_is_one_joint_pass_and_scores_as_a_cold_draft(engine, sharp_draft, forwarded, kind):
    ids, spans = prompt(engine, random_documents(2, 50, seed=21))
    store = DocumentKVCache(2**24)
    draft = ModelDraft(
        sharp_draft, 2, 13, frozenset(), document_cache=store, repair=DocumentRepair(kind, first_sight="in_context")
    )
    scored = draft.score_prompt(ids, spans)
    assert forwarded == [ids.numel() - 1]  # the prompt but its last token, once: what a cold draft prefills
    cold = ModelDraft(sharp_draft, 2, 13, frozenset()).score_prompt(ids)
    torch.testing.assert_close(scored.importance, cold.importance, atol=1e-6, rtol=1e-5)
    assert scored.documents_cached == 0 and len(store) == 1 + 2  # the prefix and both documents, stored


def test_drafting_alone_runs_more_passes_over_the_same_miss(engine, sharp_draft, forwarded):
    ids, spans = prompt(engine, random_documents(2, 50, seed=21))
    alone = DocumentRepair("naive")
    assemble_prompt_kv(sharp_draft, identity(sharp_draft), ids, spans, DocumentKVCache(2**24), alone)
    prefix, documents = int(spans.spans[0, 0]), [int(end - start) for start, end in spans.spans.tolist()]
    assert forwarded == [prefix, *documents, ids.numel() - 1 - prefix - sum(documents)]


@pytest.mark.parametrize(("kind", "share"), [("naive", 0.0), ("query", 0.2)])
def test_a_partial_hit_computes_the_tokens_not_held(engine, sharp_draft, forwarded, kind, share):
    """One document held, one new: the new one's tokens go through the draft once, in the fresh forward; the
    query repair's pass reads the question only, and its recompute covers the document held."""
    documents = random_documents(2, 50, seed=22)
    ids, spans = prompt(engine, documents)
    store = DocumentKVCache(2**24)
    held_ids, held_spans = prompt(engine, documents[:1])
    ModelDraft(sharp_draft, 2, 13, frozenset(), document_cache=store).warm(held_ids, held_spans)
    forwarded.clear()
    repair = DocumentRepair(kind, share=share, first_sight="in_context")
    assembled = assemble_prompt_kv(sharp_draft, identity(sharp_draft), ids, spans, store, repair)
    prefix = int(spans.spans[0, 0])
    (first_start, first_end), (second_start, second_end) = spans.spans.tolist()
    held, new = first_end - first_start, second_end - second_start
    recomputed = math.ceil(share * held)
    fresh = ids.numel() - 1 - prefix - held
    expected = [fresh + recomputed] if kind == "naive" else [fresh - new + 1, fresh + recomputed]
    assert forwarded == expected
    assert assembled.documents_cached == 1 and assembled.cached_tokens == held - recomputed
    assert assembled.recomputed.numel() == recomputed and bool((assembled.recomputed < first_end).all())
    assert len(store) == 1 + 2  # the new document stored from the pass


def test_a_document_stored_from_its_prompt_serves_that_prompt_as_the_joint_kv(engine, sharp_draft, forwarded):
    ids, spans = prompt(engine, random_documents(1, 60, seed=23))
    store = DocumentKVCache(2**24)
    assemble_prompt_kv(sharp_draft, identity(sharp_draft), ids, spans, store, IN_CONTEXT)
    forwarded.clear()
    hit = assemble_prompt_kv(sharp_draft, identity(sharp_draft), ids, spans, store, IN_CONTEXT)
    document = int(spans.spans[0, 1] - spans.spans[0, 0])
    assert hit.documents_cached == 1 and hit.cached_tokens == document
    assert forwarded == [ids.numel() - 1 - int(spans.spans[0, 1])]  # only what follows the document
    joint = ModelDraft(sharp_draft, 2, 13, frozenset()).score_prompt(ids).importance
    draft = ModelDraft(sharp_draft, 2, 13, frozenset(), document_cache=store, repair=IN_CONTEXT)
    torch.testing.assert_close(draft.score_prompt(ids, spans).importance, joint, atol=1e-5, rtol=1e-4)


def test_a_self_draft_miss_scores_as_its_cold_run(engine, sharp_draft):
    ids, spans = prompt(engine, random_documents(2, 50, seed=24))
    cached = LayerPrefixDraft(sharp_draft, 1, 13, 4, document_cache=DocumentKVCache(2**24), repair=IN_CONTEXT)
    cold = LayerPrefixDraft(sharp_draft, 1, 13, 4).score_prompt(ids)
    torch.testing.assert_close(cached.score_prompt(ids, spans).importance, cold.importance, atol=1e-6, rtol=1e-5)


def test_the_setting_reaches_the_engine_and_its_tenants_stay_apart(tiny_model, tokenizer, sharp_draft):
    engine = SpecPrefillEngine.from_models(
        tiny_model,
        tokenizer,
        sharp_draft,
        min_prompt_tokens=0,
        look_ahead=2,
        draft_document_cache=True,
        document_cache_mb=77,  # a store of its own
        document_first_sight="in_context",
    )
    assert engine.draft.repair == DocumentRepair("blend", first_sight="in_context")
    layout = engine.layout("When did the bridge open?", random_documents(2, 50, seed=25))
    first = engine.generate_layout(layout, GenerationParams(max_new_tokens=1)).stats
    again = engine.generate_layout(layout, GenerationParams(max_new_tokens=1)).stats
    assert first.draft_documents_cached == 0 and again.draft_documents_cached == 2
    assert engine.document_cache.held("other-tenant").entries == 0 and engine.document_cache.held(None).entries == 3


def test_a_first_sight_that_is_neither_is_refused():
    with pytest.raises(InvalidRequestError, match="'alone' or 'in_context'"):
        DocumentRepair(first_sight="joint")  # type: ignore[arg-type]
    with pytest.raises(ValidationError, match="document_first_sight"):
        SpecPrefillConfig(document_first_sight="joint")
