"""Query-aware repair of the per-document draft cache (issue #44 part 1, ProphetKV-style): the cached document
tokens recomputed in context are those the question attends to most over the assembled cached KV."""

import pytest
import torch
from transformers import DynamicCache

from specprefill_rag.config import GenerationParams, SpecPrefillConfig
from specprefill_rag.draft.assembly import DocumentSpans, assemble_prompt_kv
from specprefill_rag.draft.document_cache import DocumentKVCache
from specprefill_rag.draft.model import ModelDraft
from specprefill_rag.draft.repair import NAIVE, QUERY, DocumentRepair, recompute_count
from specprefill_rag.engine import SpecPrefillEngine
from specprefill_rag.kvcache.prefix_cache import DraftIdentity
from specprefill_rag.prompt.layout import document_runs, instructions_end
from specprefill_rag.testing import build_model, build_tokenizer, random_documents

QUESTION = "When did the bridge open?"


@pytest.fixture(scope="module")
def sharp_draft(tokenizer):
    return build_model(tokenizer, layers=2, seed=3, initializer_range=0.2)


@pytest.fixture(scope="module")
def eager_twin(tokenizer):
    """The same weights as ``sharp_draft`` (same seed), with eager attention so it can return its attention."""
    model = build_model(tokenizer, layers=2, seed=3, initializer_range=0.2)
    model.config._attn_implementation = "eager"
    return model


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer, sharp_draft):
    return SpecPrefillEngine.from_models(tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=2)


def identity(model):
    return DraftIdentity.of(model, model.config.num_hidden_layers)


def warmed_prompt(engine, model, count=3, seed=8):
    """A prompt of ``count`` documents, each warmed alone (in reverse order) into a fresh store."""
    documents = random_documents(count, 50, seed=seed)
    layout = engine.layout(QUESTION, documents)
    spans = DocumentSpans(document_runs(layout.document_index))
    store = DocumentKVCache(2**24)
    reversed_layout = engine.layout(QUESTION, documents[::-1])
    ModelDraft(model, 2, 13, frozenset(), document_cache=store).warm(
        reversed_layout.input_ids, DocumentSpans(document_runs(reversed_layout.document_index))
    )
    return layout.input_ids, spans, store


def document_positions(spans):
    return torch.cat([torch.arange(start, end) for start, end in spans.spans.tolist()])


def reference_question_attention(sharp_draft, eager_twin, ids, spans, store):
    """``[L]`` attention of the tokens after the last document onto each position, computed another way: the naive
    assembly up to the last document's end, then those tokens run by an eager twin that returns its attention
    (max over layers and heads, mean over the rows)."""
    last_end = int(spans.spans[-1, 1])
    naive = assemble_prompt_kv(sharp_draft, identity(sharp_draft), ids, spans, store, NAIVE, until=last_end)
    past = DynamicCache(config=eager_twin.config)
    for layer, mine in zip(past.layers, naive.past.layers):
        layer.lazy_initialization(mine.keys, mine.values)
        layer.keys, layer.values = mine.keys.clone(), mine.values.clone()
    tail = ids[last_end:]
    positions = torch.arange(last_end, ids.numel())
    with torch.no_grad():
        output = eager_twin(
            input_ids=tail[None],
            position_ids=positions[None],
            cache_position=positions,
            past_key_values=past,
            use_cache=True,
            output_attentions=True,
        )
    attention = torch.stack([a[0] for a in output.attentions])  # [layers, H, Q, L]
    return attention.float().amax(dim=(0, 1)).mean(dim=0)


def test_query_repair_recomputes_the_top_of_the_questions_attention(engine, sharp_draft, eager_twin):
    """The recomputed tokens are the top ``ceil(share * T)`` document tokens by the question's attention over
    the cached KV; on this prompt, KV deviation (blend) picks other tokens, which the question attends to less."""
    ids, spans, store = warmed_prompt(engine, sharp_draft)
    share = 0.2
    chosen = assemble_prompt_kv(
        sharp_draft, identity(sharp_draft), ids, spans, store, DocumentRepair("query", share=share)
    )
    blend = assemble_prompt_kv(
        sharp_draft, identity(sharp_draft), ids, spans, store, DocumentRepair("blend", share=share)
    )
    positions = document_positions(spans)
    count = recompute_count(positions.numel(), share)
    assert chosen.documents_cached == 3 and chosen.recomputed.numel() == count
    assert chosen.cached_tokens == positions.numel() - count

    attention = reference_question_attention(sharp_draft, eager_twin, ids, spans, store)
    expected = positions[torch.topk(attention[positions], count).indices].sort().values
    assert chosen.recomputed.tolist() == expected.tolist()

    assert blend.recomputed.numel() == count
    overlap = len(set(chosen.recomputed.tolist()) & set(blend.recomputed.tolist()))
    assert overlap < count // 2  # deviation and the question's attention disagree here
    assert float(attention[chosen.recomputed].sum()) > float(attention[blend.recomputed].sum())


def test_a_query_repair_of_share_0_is_the_naive_assembly(engine, sharp_draft):
    ids, spans, store = warmed_prompt(engine, sharp_draft)
    naive = assemble_prompt_kv(sharp_draft, identity(sharp_draft), ids, spans, store, NAIVE)
    nothing = assemble_prompt_kv(
        sharp_draft, identity(sharp_draft), ids, spans, store, DocumentRepair("query", share=0.0)
    )
    assert nothing.recomputed.numel() == 0 and nothing.cached_tokens == naive.cached_tokens
    for mine, theirs in zip(nothing.past.layers, naive.past.layers):
        assert torch.equal(mine.keys, theirs.keys) and torch.equal(mine.values, theirs.values)


def test_a_query_repair_of_share_1_gives_the_joint_kv_and_scores(engine, sharp_draft):
    """Every document token recomputed in context, then the question again over them: the joint encoding."""
    ids, spans, store = warmed_prompt(engine, sharp_draft)
    whole = DocumentRepair("query", share=1.0)
    assembled = assemble_prompt_kv(sharp_draft, identity(sharp_draft), ids, spans, store, whole)
    assert assembled.recomputed.tolist() == document_positions(spans).tolist() and assembled.cached_tokens == 0
    joint = DynamicCache(config=sharp_draft.config)
    with torch.no_grad():
        sharp_draft(input_ids=ids[None, :-1], past_key_values=joint, use_cache=True)
    for mine, theirs in zip(assembled.past.layers, joint.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)
    draft = ModelDraft(sharp_draft, 2, 13, frozenset(), document_cache=store, repair=whole)
    torch.testing.assert_close(
        draft.score_prompt(ids, spans).importance,
        ModelDraft(sharp_draft, 2, 13, frozenset()).score_prompt(ids).importance,
        atol=1e-5,
        rtol=1e-4,
    )


def engine_spans(engine, layout):
    first = int(document_runs(layout.document_index)[0, 0])
    return DocumentSpans(document_runs(layout.document_index), instructions_end(layout.roles, first))


def test_the_setting_reaches_the_direct_path_and_recomputes_its_share(tiny_model, tokenizer, sharp_draft):
    engine = SpecPrefillEngine.from_models(
        tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=2, document_repair="query"
    )
    assert engine.draft_path == "direct" and engine.draft.repair == DocumentRepair("query", share=0.15)
    documents = random_documents(2, 60, seed=4)
    assert engine.warm_documents(documents[::-1]) == 2
    layout = engine.layout(QUESTION, documents)
    scored = engine.draft.score_prompt(layout.input_ids, engine_spans(engine, layout))
    tokens = layout.n_document_tokens
    assert scored.documents_cached == 2 and scored.document_cached_tokens == tokens - recompute_count(tokens, 0.15)


def test_the_setting_reaches_the_mapped_path(tiny_model, tokenizer):
    draft_tokenizer = build_tokenizer(vocab_size=300)
    other = build_model(draft_tokenizer, layers=2, max_positions=4096, seed=1, initializer_range=0.2)
    settings = dict(min_prompt_tokens=0, look_ahead=2, draft_document_cache=True, document_repair="query")
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, other, draft_tokenizer=draft_tokenizer, **settings)
    naive = SpecPrefillEngine.from_models(
        tiny_model, tokenizer, other, draft_tokenizer=draft_tokenizer, **{**settings, "document_repair": "naive"}
    )
    assert engine.draft_path == "mapped"
    documents = random_documents(2, 50, seed=14)
    engine.warm_documents(documents)
    layout = engine.layout(QUESTION, documents[::-1])
    query_stats = engine.generate_layout(layout, GenerationParams(max_new_tokens=1)).stats
    naive_stats = naive.generate_layout(layout, GenerationParams(max_new_tokens=1)).stats
    assert query_stats.draft_documents_cached == naive_stats.draft_documents_cached == 2
    cached = naive_stats.draft_document_cached_tokens  # every document token of the draft's rendering
    assert query_stats.draft_document_cached_tokens == cached - recompute_count(cached, 0.15)


def test_the_setting_reaches_a_self_draft(tiny_model, tokenizer):
    engine = SpecPrefillEngine.from_models(
        tiny_model,
        tokenizer,
        None,
        draft="self:1",
        min_prompt_tokens=0,
        draft_document_cache=True,
        document_repair="query",
        document_repair_share=0.5,
    )
    assert engine.draft_path == "self" and engine.draft.repair == DocumentRepair("query", share=0.5)
    documents = random_documents(2, 50, seed=15)
    assert engine.warm_documents(documents) == 2
    layout = engine.layout(QUESTION, documents[::-1])
    stats = engine.generate_layout(layout, GenerationParams(max_new_tokens=1)).stats
    tokens = layout.n_document_tokens
    assert stats.draft_documents_cached == 2
    assert stats.draft_document_cached_tokens == tokens - recompute_count(tokens, 0.5)


def test_a_tenant_scores_with_its_own_entries_only(engine, sharp_draft):
    """The question's pass reads the KV assembled from the caller's namespace; another tenant's prompt misses."""
    documents = random_documents(2, 60, seed=6)
    layout = engine.layout(QUESTION, documents)
    spans = DocumentSpans(document_runs(layout.document_index))
    draft = ModelDraft(sharp_draft, 2, 13, frozenset(), document_cache=DocumentKVCache(2**24), repair=QUERY)
    draft.warm(layout.input_ids, spans, namespace="tenant-a")
    mine = draft.score_prompt(layout.input_ids, spans, namespace="tenant-a")
    tokens = layout.n_document_tokens
    assert mine.documents_cached == 2 and mine.document_cached_tokens == tokens - recompute_count(tokens, 0.15)
    theirs = draft.score_prompt(layout.input_ids, spans, namespace="tenant-b")
    assert theirs.documents_cached == 0 and theirs.document_cached_tokens == 0


def test_the_share_setting_applies_to_query_and_blend_only():
    assert SpecPrefillConfig(document_repair="query", document_repair_share=0.05).document_repair_share == 0.05
    with pytest.raises(ValueError, match="'blend' or 'query' only, not 'epic'"):
        SpecPrefillConfig(document_repair="epic", document_repair_share=0.05)
