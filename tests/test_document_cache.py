"""Per-document draft KV (issue #28): documents drafted once, their keys rotated to where they sit now."""

import asyncio
import gc
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from torch import nn
from transformers import DynamicCache

from specprefill_rag import engine as engine_module
from specprefill_rag.config import GenerationParams
from specprefill_rag.draft.assembly import DocumentSpans, assemble_prompt_kv
from specprefill_rag.draft.document_cache import DocumentKVCache
from specprefill_rag.draft.importance import DraftScore
from specprefill_rag.draft.model import LayerPrefixDraft, ModelDraft
from specprefill_rag.draft.paths import DraftInput, document_spans, draft_score, warm_layout
from specprefill_rag.draft.repair import BLEND, EPIC, NAIVE, DocumentRepair
from specprefill_rag.engine import SpecPrefillEngine
from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.kvcache.prefix_cache import DraftIdentity
from specprefill_rag.prompt.chat import ChatMessage
from specprefill_rag.prompt.layout import Document, Role, document_runs, instructions_end
from specprefill_rag.results import SkippedDocument, WarmReport
from specprefill_rag.serve.queue import DraftQueue
from specprefill_rag.testing import build_model, build_tokenizer, random_documents


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


REPAIRS = [NAIVE, EPIC, BLEND]


@pytest.mark.parametrize("repair", REPAIRS, ids=lambda r: r.kind)
def test_one_document_assembles_the_joint_kv(engine, sharp_draft, repair):
    layout = layout_of(engine, random_documents(1, 60, seed=1))
    ids, spans = layout.input_ids, document_runs(layout.document_index)
    store = DocumentKVCache(2**24)
    cold = assemble_prompt_kv(sharp_draft, identity(sharp_draft), ids, DocumentSpans(spans), store, repair)
    assert cold.documents_cached == 0 and cold.cached_tokens == 0 and len(store) == 2  # the prefix and the document
    assembled = assemble_prompt_kv(sharp_draft, identity(sharp_draft), ids, DocumentSpans(spans), store, repair)
    joint = joint_kv(sharp_draft, ids[:-1])
    recomputed = {"naive": 0, "epic": 16, "blend": -(-int(spans[0, 1] - spans[0, 0]) * 15 // 100)}[repair.kind]
    assert assembled.documents_cached == 1
    assert assembled.cached_tokens == int(spans[0, 1] - spans[0, 0]) - recomputed
    for mine, theirs in zip(assembled.past.layers, joint.layers):
        torch.testing.assert_close(mine.keys, theirs.keys, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(mine.values, theirs.values, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("repair", REPAIRS, ids=lambda r: r.kind)
def test_scores_with_the_cache_equal_joint_scores_for_one_document(engine, sharp_draft, repair):
    layout = layout_of(engine, random_documents(1, 80, seed=2))
    store = DocumentKVCache(2**24)
    draft = ModelDraft(sharp_draft, 3, 13, frozenset(), document_cache=store, repair=repair)
    spans = document_runs(layout.document_index)
    joint = draft.score_prompt(layout.input_ids)
    for _ in range(2):  # a miss (encoded now), then a hit
        cached = draft.score_prompt(layout.input_ids, DocumentSpans(spans))
        torch.testing.assert_close(cached.importance, joint.importance, atol=1e-5, rtol=1e-4)
    assert cached.documents_cached == 1 and 0 < cached.document_cached_tokens <= int(spans[0, 1] - spans[0, 0])


def test_documents_in_another_order_come_from_the_cache(engine, sharp_draft):
    documents = random_documents(3, 50, seed=3)
    store = DocumentKVCache(2**24)
    draft = ModelDraft(sharp_draft, 3, 13, frozenset(), document_cache=store, repair=NAIVE)
    first = layout_of(engine, documents)
    cold = draft.score_prompt(first.input_ids, DocumentSpans(document_runs(first.document_index)))
    assert cold.documents_cached == 0 and len(store) == 1 + 3
    swapped = layout_of(engine, [documents[2], documents[0]], question="Who built it?")
    warm = draft.score_prompt(swapped.input_ids, DocumentSpans(document_runs(swapped.document_index)))
    assert warm.documents_cached == 2 and warm.document_cached_tokens == swapped.n_document_tokens
    assert warm.importance.shape == (len(swapped),) and bool(torch.isfinite(warm.importance).all())


def test_the_cache_stays_within_its_bytes_and_drops_the_oldest(engine, sharp_draft):
    one = 2 * sharp_draft.config.num_hidden_layers * 2 * 16 * 4  # keys + values, layers, KV heads, head dim, fp32
    documents = random_documents(4, 40, seed=4)
    store = DocumentKVCache(int(one * 60 * 2.5))  # about two documents of ~60 tokens
    draft = ModelDraft(sharp_draft, 2, 13, frozenset(), document_cache=store)
    for document in documents:
        layout = layout_of(engine, [document])
        draft.score_prompt(layout.input_ids, DocumentSpans(document_runs(layout.document_index)))
        assert store.nbytes <= store.max_bytes
    assert 2 <= len(store) < 1 + len(documents)
    store.clear()
    assert len(store) == 0 and store.nbytes == 0


@pytest.mark.parametrize(
    "spans", [[[0, 5]], [[5, 9], [7, 12]], [[5, 4]], [[3, 10_000]]], ids=["no-prefix", "overlap", "empty", "past-end"]
)
def test_bad_spans_are_refused(engine, sharp_draft, spans):
    layout = layout_of(engine, random_documents(1, 30))
    with pytest.raises(InvalidRequestError, match="document spans"):
        assemble_prompt_kv(
            sharp_draft,
            identity(sharp_draft),
            layout.input_ids,
            DocumentSpans(torch.tensor(spans)),
            DocumentKVCache(2**20),
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
    assert stats.draft_documents_cached == 2 and 0 < stats.draft_document_cached_tokens <= swapped.n_document_tokens
    off = SpecPrefillEngine.from_models(tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=2)
    assert off.generate_layout(swapped, params).stats.draft_documents_cached == 0


def test_concurrent_scoring_equals_sequential(engine, sharp_draft):
    documents = random_documents(4, 40, seed=6)
    layouts = [layout_of(engine, [documents[i], documents[(i + 1) % 4]]) for i in range(4)] * 2
    draft = ModelDraft(sharp_draft, 2, 13, frozenset(), document_cache=DocumentKVCache(2**24))
    expected = [
        draft.score_prompt(x.input_ids, DocumentSpans(document_runs(x.document_index))).importance for x in layouts
    ]
    fresh = ModelDraft(sharp_draft, 2, 13, frozenset(), document_cache=DocumentKVCache(2**24))

    def score(layout):  # as the engine scores: under the draft model's lock (draft_score)
        return draft_score(fresh, layout.input_ids, DocumentSpans(document_runs(layout.document_index))).importance

    with ThreadPoolExecutor(max_workers=4) as pool:
        results = list(pool.map(score, layouts, timeout=120))
    for got, want in zip(results, expected):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@pytest.fixture
def passes(sharp_draft):
    """How many forward passes of the draft model run (each call's top-level forward)."""
    calls = []
    handle = sharp_draft.register_forward_pre_hook(lambda *_: calls.append(1))
    yield calls
    handle.remove()


@pytest.mark.parametrize("layers", [1, 2], ids=["first-layer", "whole"])
@pytest.mark.parametrize("window", [1, 4])
def test_a_layer_prefix_draft_caches_its_layers(engine, sharp_draft, passes, window, layers):
    """``self:<n>`` and ``draft_layers``: the first (or all) layers of a model, their KV cached per document; one
    document is exact, and a warm request with no repair is one pass: the query window runs in the assembly's fresh
    forward."""
    layout = layout_of(engine, random_documents(1, 70, seed=7))
    spans = document_runs(layout.document_index)
    store = DocumentKVCache(2**24)
    cached = LayerPrefixDraft(sharp_draft, layers, 13, window, document_cache=store, repair=NAIVE)
    joint = LayerPrefixDraft(sharp_draft, layers, 13, window).score_prompt(layout.input_ids)
    for _ in range(2):
        passes.clear()
        scored = cached.score_prompt(layout.input_ids, DocumentSpans(spans))
        torch.testing.assert_close(scored.importance, joint.importance, atol=1e-5, rtol=1e-4)
    assert scored.documents_cached == 1 and len(passes) == 1
    (key, entry), *_ = store._entries.items()
    assert key[0].layers == layers and len(entry.layers) == layers  # only the layers the draft runs


@pytest.mark.parametrize("first_sight", ["alone", "in_context"])
def test_a_layer_prefix_draft_recomputing_every_token_scores_as_joint(engine, sharp_draft, first_sight):
    """Two documents drafted in the other order, then moved: with every document token recomputed in context, the
    window scored in the same pass sees the joint KV."""
    documents = random_documents(2, 60, seed=8)
    layout = layout_of(engine, documents)
    whole = DocumentRepair("blend", share=1.0, first_sight=first_sight)
    draft = LayerPrefixDraft(sharp_draft, 2, 13, 4, document_cache=DocumentKVCache(2**24), repair=whole)
    reversed_layout = layout_of(engine, documents[::-1])
    draft.warm(reversed_layout.input_ids, DocumentSpans(document_runs(reversed_layout.document_index)))
    scored = draft.score_prompt(layout.input_ids, DocumentSpans(document_runs(layout.document_index)))
    joint = LayerPrefixDraft(sharp_draft, 2, 13, 4).score_prompt(layout.input_ids).importance
    assert scored.documents_cached == 2
    torch.testing.assert_close(scored.importance, joint, atol=1e-5, rtol=1e-4)


def test_two_documents_moved_stay_close_to_joint_with_blend(engine, sharp_draft):
    """Not exact (documents do not see each other), but the repair closes most of the gap to joint scores."""
    documents = random_documents(2, 60, seed=8)
    layout = layout_of(engine, documents)
    spans = document_runs(layout.document_index)
    joint = ModelDraft(sharp_draft, 2, 13, frozenset()).score_prompt(layout.input_ids).importance
    errors = {}
    for repair in (NAIVE, DocumentRepair("blend", share=1.0)):
        draft = ModelDraft(sharp_draft, 2, 13, frozenset(), document_cache=DocumentKVCache(2**24), repair=repair)
        reversed_layout = layout_of(engine, documents[::-1])
        draft.warm(reversed_layout.input_ids, DocumentSpans(document_runs(reversed_layout.document_index)))
        scored = draft.score_prompt(layout.input_ids, DocumentSpans(spans))
        assert scored.documents_cached == 2
        errors[repair.kind] = float((scored.importance - joint).abs().max())
    assert errors["blend"] < 1e-5 < errors["naive"]  # every token recomputed in context: the joint KV again


def test_the_engine_setting_picks_the_repair(tiny_model, tokenizer, sharp_draft):
    """``document_repair`` reaches the engine's draft: it scores as a draft built with that repair, and the
    repairs differ on two documents moved."""
    documents = random_documents(2, 60, seed=8)
    scores = {}
    for kind in ("naive", "epic", "blend"):
        engine = SpecPrefillEngine.from_models(
            tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=2, document_repair=kind
        )
        assert engine.warm_documents(documents[::-1]) == 2
        layout = layout_of(engine, documents)
        first = int(document_runs(layout.document_index)[0, 0])
        spans = DocumentSpans(document_runs(layout.document_index), instructions_end(layout.roles, first))
        scored = engine.draft.score_prompt(layout.input_ids, spans)
        built = ModelDraft(
            sharp_draft, 2, 13, frozenset(), document_cache=engine.document_cache, repair=DocumentRepair(kind)
        )
        assert scored.documents_cached == 2
        torch.testing.assert_close(scored.importance, built.score_prompt(layout.input_ids, spans).importance)
        scores[kind] = scored.importance
    assert not torch.allclose(scores["naive"], scores["blend"])


def test_the_blend_share_setting_reaches_every_draft_path(tiny_model, tokenizer, sharp_draft):
    """``document_repair_share`` sets how much blend recomputes, for a draft model and a ``self`` draft alike."""
    engines = [
        SpecPrefillEngine.from_models(tiny_model, tokenizer, sharp_draft, document_repair_share=0.05),
        SpecPrefillEngine.from_models(tiny_model, tokenizer, None, draft="self:1", document_repair_share=0.05),
    ]
    assert [engine.draft.repair for engine in engines] == [DocumentRepair("blend", share=0.05)] * 2
    default = SpecPrefillEngine.from_models(tiny_model, tokenizer, sharp_draft)
    assert default.draft.repair == DocumentRepair("blend", share=0.15)


def test_the_engine_blend_share_decides_how_close_to_joint_scores(tiny_model, tokenizer):
    """Blend's share is the share of cached document tokens computed in context: share 1 scores as the joint
    draft, a small share does not. Four layers: blend's two probe layers are joint already."""
    deep_draft = build_model(tokenizer, layers=4, seed=3, initializer_range=0.2)
    documents = random_documents(2, 60, seed=8)
    errors = {}
    for share in (0.05, 1.0):
        engine = SpecPrefillEngine.from_models(
            tiny_model, tokenizer, deep_draft, min_prompt_tokens=0, look_ahead=2, document_repair_share=share
        )
        engine.warm_documents(documents[::-1])
        layout = layout_of(engine, documents)
        first = int(document_runs(layout.document_index)[0, 0])
        spans = DocumentSpans(document_runs(layout.document_index), instructions_end(layout.roles, first))
        scored = engine.draft.score_prompt(layout.input_ids, spans)
        joint = ModelDraft(deep_draft, 2, 13, frozenset()).score_prompt(layout.input_ids)
        assert scored.documents_cached == 2
        errors[share] = float((scored.importance - joint.importance).abs().max())
    assert errors[1.0] < 1e-5 < errors[0.05]


def test_a_self_draft_engine_takes_the_repair_setting(tiny_model, tokenizer):
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, None, draft="self:1", document_repair="naive")
    assert engine.draft.repair == NAIVE


def test_warm_documents_fills_the_cache_for_later_requests(tiny_model, tokenizer, sharp_draft):
    engine = SpecPrefillEngine.from_models(
        tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=2, draft_document_cache=True
    )
    documents = random_documents(3, 50, seed=9)
    assert engine.warm_documents(documents, instructions="Answer briefly.") == 3
    layout = engine.layout("Which one?", documents[::-1], instructions="Answer briefly.")
    stats = engine.generate_layout(layout, GenerationParams(max_new_tokens=1)).stats
    assert stats.draft_documents_cached == 3


def test_titled_documents_warmed_alone_are_served_in_any_order(tiny_model, tokenizer, sharp_draft):
    """Labels (``Document [i] <title>``) are fresh tokens, not part of the key: a warm-up serves titled documents
    wherever they come in a later prompt."""
    engine = SpecPrefillEngine.from_models(
        tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=2, draft_document_cache=True
    )
    texts = random_documents(3, 50, seed=21)
    documents = [Document(text, title=f"Source {i}") for i, text in enumerate(texts)]
    assert engine.warm_documents(documents, instructions="Answer briefly.") == 3
    layout = engine.layout("Which one?", documents[::-1], instructions="Answer briefly.")
    stats = engine.generate_layout(layout, GenerationParams(max_new_tokens=1)).stats
    assert stats.draft_documents_cached == 3


def test_the_documents_prefix_ends_with_the_instructions(engine):
    layout = engine.layout("Which one?", [Document(random_documents(1, 30)[0], title="A title")], "Be brief.")
    documents = document_spans(DraftInput(layout, layout))
    first = int(documents.spans[0, 0])
    instruction_tokens = torch.nonzero(layout.roles == Role.INSTRUCTION).flatten()
    assert documents.prefix_length == int(instruction_tokens[-1]) + 1 < first
    label = engine.tokenizer.decode(layout.input_ids[documents.prefix_length : first])
    assert "Document [1] A title" in label


def test_without_instructions_the_prefix_is_the_first_token():
    roles = torch.tensor([Role.TEMPLATE, Role.TEMPLATE, Role.TEMPLATE, Role.DOCUMENT, Role.QUESTION])
    assert instructions_end(roles, 3) == 1
    roles[1] = Role.INSTRUCTION
    assert instructions_end(roles, 3) == 2


def test_a_prompt_that_opens_with_a_document_is_drafted_jointly(tiny_model, tokenizer, sharp_draft):
    """A plain completion without a template can start with document text: no prefix to encode it after, so the
    draft reads it whole (was a 400 naming the spans)."""
    engine = SpecPrefillEngine.from_models(
        tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=2, draft_document_cache=True
    )
    layout = engine.text_layout(" ".join(random_documents(2, 60, seed=22)) + " Which one?")
    assert int(layout.document_index[0]) >= 0
    stats = engine.generate_layout(layout, GenerationParams(max_new_tokens=1)).stats
    assert stats.compressed and stats.draft_documents_cached == 0


@pytest.mark.parametrize("prefix_length", [0, 6])
def test_a_prefix_past_the_first_document_is_refused(engine, sharp_draft, prefix_length):
    layout = layout_of(engine, random_documents(1, 30))
    spans = torch.tensor([[5, 12]])
    with pytest.raises(InvalidRequestError, match="prefix"):
        assemble_prompt_kv(
            sharp_draft,
            identity(sharp_draft),
            layout.input_ids,
            DocumentSpans(spans, prefix_length),
            DocumentKVCache(2**20),
        )


def test_warm_documents_stops_at_the_cache_size(tiny_model, tokenizer, sharp_draft):
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=2)
    engine.draft.document_cache = DocumentKVCache(2 * 2 * 2 * 16 * 4 * 200)  # about 200 tokens of KV
    warmed = engine.warm_documents(random_documents(6, 50, seed=10))
    assert 1 <= warmed < 6 and len(engine.draft.document_cache) == 1 + warmed
    assert engine.draft.document_cache.nbytes <= engine.draft.document_cache.max_bytes


def test_warm_documents_stops_before_the_next_document_once_told(tiny_model, tokenizer, sharp_draft, monkeypatch):
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=2)
    engine.draft.document_cache = DocumentKVCache(2**24)
    stop = threading.Event()

    def warm_then_stop(scoring, layout, namespace=None):
        held = warm_layout(scoring, layout, namespace)
        stop.set()  # as a caller's deadline passing while this document is drafted
        return held

    monkeypatch.setattr(engine_module, "warm_layout", warm_then_stop)
    report = engine.warm_report(random_documents(3, 30, seed=11), stop=stop)
    assert report == WarmReport(1, (SkippedDocument(1, "stopped"), SkippedDocument(2, "stopped")))
    assert len(engine.draft.document_cache) == 2  # the prefix and the first document


def test_a_warm_up_never_drops_what_the_cache_holds(tiny_model, tokenizer, sharp_draft):
    """The cache nearly full, a document too big for the room left is skipped (not drafted over held entries),
    and so is every document after it; what the cache held is all still there."""
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=2)
    cache = engine.draft.document_cache = DocumentKVCache(2 * 2 * 2 * 16 * 4 * 300)  # about 300 tokens of KV
    held = random_documents(2, 50, seed=12)
    assert engine.warm_report(held) == WarmReport(2)
    entries, used = len(cache), cache.nbytes
    big, small = random_documents(1, 200, seed=13)[0], random_documents(1, 5, seed=14)[0]
    report = engine.warm_report([big, small])
    assert report == WarmReport(0, (SkippedDocument(0, "cache_full"), SkippedDocument(1, "cache_full")))
    assert len(cache) == entries and cache.nbytes == used
    assert engine.warm_report(held) == WarmReport(2) and len(cache) == entries  # found, not drafted again


def test_a_document_the_draft_cannot_read_is_refused_before_any_is_drafted(tiny_model, tokenizer, sharp_draft):
    """Alone or among others the same 400-kind error, naming the document; nothing drafted."""
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=2)
    cache = engine.draft.document_cache = DocumentKVCache(2**24)
    short, too_long = random_documents(1, 30, seed=15)[0], random_documents(1, 3000, seed=16)[0]
    for documents, index in [([too_long], 0), ([short, too_long, short], 1)]:
        with pytest.raises(InvalidRequestError, match=f"document {index} cannot be warmed: .*draft's context"):
            engine.warm_report(documents)
        assert len(cache) == 0


def test_without_a_cache_nothing_is_warmed(tiny_model, tokenizer, sharp_draft):
    engine = SpecPrefillEngine.from_models(
        tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=2, document_cache_mb=0
    )
    assert engine.warm_documents(random_documents(2, 20)) == 0


def test_a_model_collected_frees_its_entries(tokenizer, engine):
    model = build_model(tokenizer, layers=1, seed=11)
    store = DocumentKVCache(2**24)
    layout = layout_of(engine, random_documents(2, 30, seed=11))
    ModelDraft(model, 2, 13, frozenset(), document_cache=store).warm(
        layout.input_ids, DocumentSpans(document_runs(layout.document_index))
    )
    assert len(store) == 3
    del model
    gc.collect()
    assert len(store) == 0 and store.nbytes == 0


@pytest.mark.parametrize(
    "repair", [{"kind": "other"}, {"share": 1.5}, {"first_tokens": -1}, {"probe_layers": 0}], ids=str
)
def test_bad_repairs_are_refused(repair):
    with pytest.raises(InvalidRequestError, match="repair"):
        DocumentRepair(**repair)


def test_float_spans_are_refused(engine, sharp_draft):
    layout = layout_of(engine, random_documents(1, 30))
    with pytest.raises(InvalidRequestError, match="integer"):
        assemble_prompt_kv(
            sharp_draft,
            identity(sharp_draft),
            layout.input_ids,
            DocumentSpans(torch.tensor([[3.0, 9.0]])),
            DocumentKVCache(2**20),
        )


def test_the_gateway_queue_carries_document_spans(engine, sharp_draft):
    draft = ModelDraft(sharp_draft, 2, 13, frozenset(), document_cache=DocumentKVCache(2**24))
    layouts = [layout_of(engine, random_documents(2, 40, seed=s)) for s in (12, 13)]
    calls = []

    def score_batch(prompts, documents=None):
        calls.append(documents)
        return draft.score_batch(prompts, documents)

    async def run():
        queue = DraftQueue(score_batch, capacity=8, batch_size=4, batch_tokens=10_000, window_s=0.01)
        try:
            with_spans = queue.score(layouts[0].input_ids, DocumentSpans(document_runs(layouts[0].document_index)))
            return await asyncio.gather(with_spans, queue.score(layouts[1].input_ids))
        finally:
            await queue.stop()

    served, joint = asyncio.run(run())
    assert calls[-1] is not None and calls[-1][1] is None  # spans went through, per prompt
    assert served.documents_cached == 0 and served.batch_size == 2 and joint.document_cached_tokens == 0
    again = asyncio.run(_score_alone(score_batch, layouts[0]))
    assert again.documents_cached == 2 and again.document_cached_tokens > 0
    assert calls[0] is not None


async def _score_alone(score_batch, layout):
    queue = DraftQueue(score_batch, capacity=8, batch_size=4, batch_tokens=10_000, window_s=0.0)
    try:
        return await queue.score(layout.input_ids, DocumentSpans(document_runs(layout.document_index)))
    finally:
        await queue.stop()


def test_a_one_argument_batch_function_still_works(engine):
    def score_batch(prompts):
        return [DraftScore(torch.ones(p.numel())) for p in prompts]

    async def run():
        queue = DraftQueue(score_batch, capacity=8, batch_size=4, batch_tokens=10_000, window_s=0.0)
        try:
            return await queue.score(torch.arange(5))
        finally:
            await queue.stop()

    assert asyncio.run(run()).importance.shape == (5,)


def test_the_mapped_path_caches_the_documents_as_the_draft_reads_them(tiny_model, tokenizer):
    """A draft of another vocabulary: the spans are those of its own rendering of the prompt."""
    draft_tokenizer = build_tokenizer(vocab_size=300)
    other = build_model(draft_tokenizer, layers=1, max_positions=4096, seed=1)
    engine = SpecPrefillEngine.from_models(
        tiny_model,
        tokenizer,
        other,
        draft_tokenizer=draft_tokenizer,
        min_prompt_tokens=0,
        look_ahead=2,
        draft_document_cache=True,
    )
    assert engine.draft_path == "mapped"
    documents = random_documents(2, 50, seed=14)
    assert engine.warm_documents(documents) == 2
    stats = engine.generate_layout(layout_of(engine, documents[::-1]), GenerationParams(max_new_tokens=1)).stats
    assert stats.draft_documents_cached == 2


def test_a_self_draft_engine_caches_its_first_layers(tiny_model, tokenizer):
    engine = SpecPrefillEngine.from_models(
        tiny_model, tokenizer, None, draft="self:1", min_prompt_tokens=0, draft_document_cache=True
    )
    documents = random_documents(2, 50, seed=15)
    assert engine.draft_path == "self" and engine.warm_documents(documents) == 2
    stats = engine.generate_layout(layout_of(engine, documents[::-1]), GenerationParams(max_new_tokens=1)).stats
    assert stats.draft_documents_cached == 2


# -- the per-request flag (draft_document_cache=None: the config's) ----------------------------------


@pytest.fixture(scope="module")
def flag_engine(tiny_model, tokenizer, sharp_draft):
    """Config off, cache present: only requests that ask use it."""
    return SpecPrefillEngine.from_models(tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=2)


@pytest.mark.parametrize("entry", ["generate", "agenerate", "generate_layout", "agenerate_layout", "chat"])
def test_a_request_asks_for_the_cache_on_every_entry_point(flag_engine, entry):
    documents = random_documents(2, 60, seed=16 + len(entry))
    ask = _entry_points(flag_engine)[entry]
    assert ask(documents, None).draft_documents_cached == 0  # the config's: off
    assert ask(documents, True).draft_documents_cached == 0  # drafted now, stored
    assert ask(documents[::-1], True).draft_documents_cached == 2
    assert ask(documents[::-1], False).draft_documents_cached == 0


def _entry_points(engine):
    params = {"max_new_tokens": 1}

    def layout(documents):
        return layout_of(engine, documents)

    return {
        "generate": lambda d, flag: engine.generate("Why?", d, None, None, flag, **params).stats,
        "agenerate": lambda d, flag: (
            asyncio.run(engine.agenerate("Why?", d, draft_document_cache=flag, **params)).stats
        ),
        "generate_layout": lambda d, flag: (
            engine.generate_layout(layout(d), GenerationParams(**params), draft_document_cache=flag).stats
        ),
        "agenerate_layout": lambda d, flag: (
            asyncio.run(engine.agenerate_layout(layout(d), GenerationParams(**params), None, None, flag)).stats
        ),
        "chat": lambda d, flag: (
            engine.chat([ChatMessage("user", ["Why?"])], documents=d, draft_document_cache=flag, **params).stats
        ),
    }


def test_a_request_turns_the_configs_cache_off(tiny_model, tokenizer, sharp_draft):
    engine = SpecPrefillEngine.from_models(
        tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=2, draft_document_cache=True
    )
    documents = random_documents(2, 60, seed=30)
    engine.generate("Why?", documents, max_new_tokens=1)
    assert engine.generate("Who?", documents[::-1], max_new_tokens=1).stats.draft_documents_cached == 2
    off = engine.generate("Who?", documents[::-1], draft_document_cache=False, max_new_tokens=1)
    assert off.stats.draft_documents_cached == 0 and off.stats.draft_document_cached_tokens == 0


def test_asking_an_engine_without_the_cache_names_the_setting(tiny_model, tokenizer, sharp_draft):
    engine = SpecPrefillEngine.from_models(
        tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=2, document_cache_mb=0
    )
    with pytest.raises(InvalidRequestError, match="document_cache_mb=0.*document_cache_mb above 0"):
        engine.generate("Why?", random_documents(2, 40), draft_document_cache=True, max_new_tokens=1)
    assert engine.generate("Why?", random_documents(2, 40), draft_document_cache=False, max_new_tokens=1).text


def test_the_setting_without_a_cache_is_refused():
    from pydantic import ValidationError

    from specprefill_rag import SpecPrefillConfig
    from specprefill_rag.serve import GatewaySettings

    for settings in (SpecPrefillConfig, GatewaySettings):
        with pytest.raises(ValidationError, match="draft_document_cache is on but document_cache_mb is 0"):
            settings(draft_document_cache=True, document_cache_mb=0)


def test_warm_documents_checks_every_document_first(tiny_model, tokenizer, sharp_draft):
    engine = SpecPrefillEngine.from_models(tiny_model, tokenizer, sharp_draft, min_prompt_tokens=0, look_ahead=2)
    engine.draft.document_cache = store = DocumentKVCache(2**24)
    with pytest.raises(InvalidRequestError, match="document 2 is empty"):
        engine.warm_documents(["one", "two", " "])
    with pytest.raises(InvalidRequestError, match="instructions is empty"):
        engine.warm_documents(["one"], instructions=" ")
    assert len(store) == 0  # nothing was drafted


def test_the_blend_probe_stops_once_its_last_layer_has_its_keys(tokenizer):
    """The probe's joint KV equals a full forward's in its layers, and the last probe layer's attention and
    MLP never run (they would only feed the layers after it)."""
    from specprefill_rag.draft.assembly import _probe
    from specprefill_rag.draft.hooks import decoder_layers

    model = build_model(tokenizer, layers=4, seed=5, initializer_range=0.2)
    ids = torch.randint(5, tokenizer.vocab_size, (40,))
    ran = []
    handle = decoder_layers(model)[1].mlp.register_forward_hook(lambda *_: ran.append(1))
    try:
        probed = _probe(model, ids, 2)
    finally:
        handle.remove()
    full = joint_kv(model, ids)
    assert not ran and len(probed) == 2
    for (keys, values), layer in zip(probed, full.layers[:2]):
        torch.testing.assert_close(keys, layer.keys)
        torch.testing.assert_close(values, layer.values)


@pytest.mark.parametrize("fresh_share", [0.05, 0.5, 1.0])
def test_grouped_masked_attention_equals_one_mask(fresh_share):
    """The fresh forward's attention (keys in position order, queries in groups that each read only the keys up
    to their latest position) equals SDPA with one ``[F, C + F]`` mask, grouped-query heads included."""
    from specprefill_rag.draft.assembly import _masked_attention

    generator = torch.Generator().manual_seed(7)
    length = 90
    fresh = torch.nonzero(torch.rand(length, generator=generator) < fresh_share).flatten()
    fresh = torch.cat([fresh, torch.tensor([length - 1])]).unique()  # the last token is always fresh
    kept = torch.tensor([p for p in range(length) if p not in set(fresh.tolist())], dtype=torch.long)
    key_positions = torch.cat([kept, fresh])  # cache slot order: cached keys, then the fresh ones
    query = torch.randn(1, 4, fresh.numel(), 8, generator=generator)
    key, value = (torch.randn(1, 2, length, 8, generator=generator) for _ in range(2))
    module = nn.Module()
    module.num_key_value_groups = 2
    grouped, _ = _masked_attention(key_positions, fresh)(module, query, key, value, None, scaling=0.3)
    mask = key_positions[None, :] <= fresh[:, None]
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, key.repeat_interleave(2, dim=1), value.repeat_interleave(2, dim=1), attn_mask=mask, scale=0.3
    ).transpose(1, 2)
    assert grouped.shape == expected.shape == (1, fresh.numel(), 4, 8)
    torch.testing.assert_close(grouped, expected)
