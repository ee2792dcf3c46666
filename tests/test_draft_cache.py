"""Draft prefix KV cache: hits score exactly as cold runs, never across documents or drafts, bounded by bytes."""

import gc
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from pydantic import ValidationError

from specprefill_rag import GenerationParams, SpecPrefillConfig, SpecPrefillEngine
from specprefill_rag.draft.model import LayerPrefixDraft, ModelDraft
from specprefill_rag.kvcache.prefix_cache import DraftIdentity, PrefixKVCache, PrefixReuse, common_prefix_length
from specprefill_rag.testing import build_model, build_tokenizer, random_documents

QUESTIONS = ["When did the bridge open?", "What is the capital of France?", "Who wrote the documents?"]


def ids_of(tokenizer, documents, question):
    return torch.tensor(tokenizer(" ".join(documents) + " Question: " + question)["input_ids"])


@pytest.fixture(scope="module")
def prompts(tokenizer):
    """Two prompts over the same documents with different questions, and one over other documents."""
    documents = random_documents(3, 80, seed=4)
    first, second = (ids_of(tokenizer, documents, q) for q in QUESTIONS[:2])
    other = ids_of(tokenizer, random_documents(3, 80, seed=5), QUESTIONS[0])
    return first, second, other


def scorers(model, cache):
    """(cold, cached) pairs of every draft kind: model drafts with and without look-ahead, and a layer-prefix
    draft with a window of 5 queries (both layers of the tiny model, so layer 0's attention output matters)."""
    return {
        "model-la1": (ModelDraft(model, look_ahead=1), ModelDraft(model, look_ahead=1, prefix_cache=cache)),
        "model-la4": (ModelDraft(model, look_ahead=4), ModelDraft(model, look_ahead=4, prefix_cache=cache)),
        "self-w5": (LayerPrefixDraft(model, 2, 13, 5), LayerPrefixDraft(model, 2, 13, 5, prefix_cache=cache)),
    }


@pytest.mark.parametrize("kind", ["model-la1", "model-la4", "self-w5"])
def test_hit_scores_as_a_cold_run(tiny_model, prompts, kind):
    first, second, _ = prompts
    cold, cached = scorers(tiny_model, PrefixKVCache(2**30))[kind]
    assert cached.score_prompt(first).cached_tokens == 0
    hit = cached.score_prompt(second)
    assert hit.cached_tokens == common_prefix_length(first, second) > 200
    torch.testing.assert_close(hit.importance, cold.score(second), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind", ["model-la4", "self-w5"])
def test_a_short_hit_attends_in_query_blocks_as_a_cold_run(tiny_model, prompts, monkeypatch, kind):
    first, _, other = prompts
    monkeypatch.setattr("specprefill_rag.draft.hooks.QUERY_BLOCK", 16)  # ~18 blocks of queries after the cached keys
    cold, cached = scorers(tiny_model, PrefixKVCache(2**30, min_reuse_share=0.0))[kind]
    cached.score_prompt(first)
    prompt = torch.cat([first[:10], other])
    hit = cached.score_prompt(prompt)
    assert hit.cached_tokens == common_prefix_length(first, prompt) >= 10
    torch.testing.assert_close(hit.importance, cold.score(prompt), rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("kind, reuse_at_most", [("model-la4", 1), ("self-w5", 5)])
def test_the_same_prompt_again_recomputes_its_query_tokens(tiny_model, prompts, kind, reuse_at_most):
    first = prompts[0]
    cold, cached = scorers(tiny_model, PrefixKVCache(2**30))[kind]
    cached.score_prompt(first)
    again = cached.score_prompt(first)
    assert again.cached_tokens == first.numel() - reuse_at_most
    torch.testing.assert_close(again.importance, cold.score(first), rtol=1e-5, atol=1e-7)


def test_a_hit_shares_the_entry_and_never_writes_into_it(tiny_model, prompts):
    first, second, _ = prompts
    cache = PrefixKVCache(2**30)
    draft = ModelDraft(tiny_model, look_ahead=4, prefix_cache=cache)
    draft.score_prompt(first)
    (entry,) = cache._entries.values()
    before = [(k.clone(), v.clone()) for k, v in entry.layers]
    identity = DraftIdentity.of(tiny_model, tiny_model.config.num_hidden_layers)
    reuse = PrefixReuse.begin(cache, tiny_model, identity.layers, second, second.numel() - 1, needs_past=True)
    assert reuse.past.layers[0].keys.data_ptr() == entry.layers[0][0].data_ptr()  # a view, not a copy
    draft.score_prompt(second)
    for (keys, values), (old_keys, old_values) in zip(entry.layers, before):
        assert torch.equal(keys, old_keys) and torch.equal(values, old_values)


def test_different_documents_never_hit(tiny_model, prompts):
    first, _, other = prompts
    cache = PrefixKVCache(2**30, min_reuse_share=0.0)
    draft = ModelDraft(tiny_model, look_ahead=4, prefix_cache=cache)
    draft.score_prompt(first)
    assert draft.score_prompt(other).cached_tokens == common_prefix_length(first, other) < 5
    header = torch.arange(40)  # a shared template header, then different documents: reuse stops at the first difference
    result = draft.score_prompt(torch.cat([header, other]))
    draft.score_prompt(torch.cat([header, first]))
    assert int(other[-3]) != 5
    diverging = torch.cat([header, other[:-3], torch.tensor([5, 5, 5])])
    assert draft.score_prompt(diverging).cached_tokens == 37 + other.numel()
    cold = ModelDraft(tiny_model, look_ahead=4).score(torch.cat([header, other]))
    torch.testing.assert_close(result.importance, cold)


def test_a_prefix_cached_by_another_draft_never_hits(tokenizer, tiny_model, prompts):
    first = prompts[0]
    cache = PrefixKVCache(2**30, min_reuse_share=0.0)
    twin = build_model(tokenizer, layers=2, seed=7)  # same shapes, other weights: a wrong hit would not crash
    ModelDraft(tiny_model, look_ahead=4, prefix_cache=cache).score_prompt(first)
    result = ModelDraft(twin, look_ahead=4, prefix_cache=cache).score_prompt(first)
    assert result.cached_tokens == 0
    torch.testing.assert_close(result.importance, ModelDraft(twin, look_ahead=4).score(first))
    # the same model run for fewer layers is another draft too
    assert LayerPrefixDraft(tiny_model, 1, 13, 5, prefix_cache=cache).score_prompt(first).cached_tokens == 0
    assert len(cache) == 3


def test_entries_of_a_collected_model_are_freed(tokenizer, prompts):
    cache = PrefixKVCache(2**30, min_reuse_share=0.0)
    model = build_model(tokenizer, layers=1, seed=3)
    ModelDraft(model, look_ahead=1, prefix_cache=cache).score_prompt(prompts[0])
    assert len(cache) == 1 and cache.nbytes > 0
    del model
    gc.collect()
    assert len(cache) == 0 and cache.nbytes == 0


def fake_kv(token_ids, layers=2, heads=2, dim=4):
    """KV whose every vector holds its token's id: a hit's slices must read back the prompt's own ids."""
    keys = token_ids.float()[None, None, :, None].expand(1, heads, -1, dim)
    return tuple((keys.clone(), keys.clone()) for _ in range(layers))


def entry_bytes(length, layers=2, heads=2, dim=4):
    return 2 * layers * heads * length * dim * 4


def test_eviction_by_bytes_least_recently_used_first(tiny_model):
    draft = DraftIdentity.of(tiny_model, 2)
    cache = PrefixKVCache(max_bytes=entry_bytes(100) * 2 + entry_bytes(50), min_reuse_share=0.0)
    a, b, c = (torch.arange(100) + offset for offset in (0, 1000, 2000))
    for ids in (a, b):
        cache.store(tiny_model, draft, ids, fake_kv(ids))
    assert cache.nbytes == entry_bytes(100) * 2
    assert cache.lookup(draft, a, 99).tokens == 99  # a is now the most recently used
    cache.store(tiny_model, draft, c, fake_kv(c))
    assert cache.nbytes == entry_bytes(100) * 2 <= cache.max_bytes
    assert cache.lookup(draft, b, 99) is None  # b went first
    assert cache.lookup(draft, a, 99) is not None and cache.lookup(draft, c, 99) is not None
    cache.store(tiny_model, draft, torch.arange(500), fake_kv(torch.arange(500)))  # larger than the budget: not kept
    assert cache.lookup(draft, torch.arange(500), 499).tokens == 100  # a (all of it), not the 500-token entry


def test_an_extended_prompt_replaces_its_prefix_entry(tiny_model):
    draft = DraftIdentity.of(tiny_model, 2)
    cache = PrefixKVCache(2**30, min_reuse_share=0.0)
    turn_one, turn_two = torch.arange(60), torch.arange(90)
    cache.store(tiny_model, draft, turn_one, fake_kv(turn_one))
    cache.store(tiny_model, draft, turn_two, fake_kv(turn_two))
    assert len(cache) == 1 and cache.nbytes == entry_bytes(90)
    cache.store(tiny_model, draft, turn_one, fake_kv(turn_one))  # already covered by the longer entry
    assert len(cache) == 1


def test_common_prefixes_under_half_the_prompt_are_misses(tiny_model):
    draft = DraftIdentity.of(tiny_model, 2)
    cache = PrefixKVCache(2**30)
    cache.store(tiny_model, draft, torch.arange(100), fake_kv(torch.arange(100)))
    assert cache.lookup(draft, torch.cat([torch.arange(49), torch.full((51,), -1)]), 99) is None
    assert cache.lookup(draft, torch.cat([torch.arange(50), torch.full((50,), -1)]), 99).tokens == 50


def test_concurrent_stores_and_lookups_stay_consistent(tiny_model):
    draft = DraftIdentity.of(tiny_model, 2)
    cache = PrefixKVCache(max_bytes=entry_bytes(64) * 5, min_reuse_share=0.0)
    shared = torch.arange(48)
    errors = []

    def worker(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        for _ in range(50):
            ids = torch.cat([shared, 1000 + torch.randint(200, (16,), generator=generator)])
            hit = cache.lookup(draft, ids, ids.numel() - 1)
            expected = ids[: hit.tokens].float() if hit else None
            if hit is not None and not all(torch.equal(k[0, 0, :, 0], expected) for k, _ in hit.layers):
                errors.append(seed)
            cache.store(tiny_model, draft, ids, fake_kv(ids))

    threads = [threading.Thread(target=worker, args=(seed,)) for seed in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert not errors and not any(thread.is_alive() for thread in threads)
    assert cache.nbytes == sum(entry.nbytes for entry in cache._entries.values()) <= cache.max_bytes
    assert cache.lookup(draft, shared, 48).tokens == 48


def test_sliding_window_drafts_are_not_cached(tokenizer):
    from transformers import MistralConfig, MistralForCausalLM

    config = MistralConfig(
        vocab_size=len(tokenizer),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        sliding_window=16,
    )
    config._attn_implementation = "sdpa"
    model = MistralForCausalLM(config).eval()
    cache = PrefixKVCache(2**30, min_reuse_share=0.0)
    reuse = PrefixReuse.begin(cache, model, 1, torch.arange(40), 39, needs_past=True)
    assert reuse.cache is None and reuse.cached_tokens == 0


# -- engine --------------------------------------------------------------------------------------


@pytest.fixture()
def engines(tiny_model, tiny_draft, tokenizer):
    """A cached engine (its own budget, so no other test's entries) and a cold one, same models."""
    settings = dict(keep_rate=0.2, min_prompt_tokens=0, look_ahead=3)
    cached = SpecPrefillEngine.from_models(tiny_model, tokenizer, tiny_draft, draft_cache_mb=7, **settings)
    cached.draft.prefix_cache.clear()
    cold = SpecPrefillEngine.from_models(tiny_model, tokenizer, tiny_draft, draft_cache_mb=0, **settings)
    return cached, cold


def test_stats_report_cached_draft_tokens(engines):
    cached, cold = engines
    documents = random_documents(3, 80, seed=11)
    first = cached.generate(QUESTIONS[0], documents, max_new_tokens=2)
    second_layout = cached.layout(QUESTIONS[1], documents)
    second = cached.generate_layout(second_layout, GenerationParams(max_new_tokens=2))
    assert first.stats.draft_cached_tokens == 0
    shared = common_prefix_length(cached.layout(QUESTIONS[0], documents).input_ids, second_layout.input_ids)
    assert second.stats.draft_cached_tokens == shared > second_layout.n_document_tokens
    assert torch.equal(second.kept_positions, cold.select(second_layout).kept)
    assert cold.draft.prefix_cache is None and cold.select(second_layout).draft_cached_tokens == 0


def test_concurrent_requests_on_the_same_documents(engines):
    cached, cold = engines
    documents = random_documents(4, 80, seed=12)
    layouts = [cached.layout(question, documents) for question in QUESTIONS * 2]

    def answer(layout):
        return cached.generate_layout(layout, GenerationParams(max_new_tokens=2))

    with ThreadPoolExecutor(max_workers=6) as pool:
        results = list(pool.map(answer, layouts, timeout=120))
    assert sum(result.stats.draft_cached_tokens > 0 for result in results) >= 5  # all but the first to score
    for layout, result in zip(layouts, results):
        assert torch.equal(result.kept_positions, cold.select(layout).kept)


def test_self_draft_engine_uses_the_cache(tiny_model, tokenizer):
    engine = SpecPrefillEngine.from_models(
        tiny_model, tokenizer, draft="self:1", keep_rate=0.3, min_prompt_tokens=0, draft_cache_mb=5
    )
    documents = random_documents(3, 80, seed=13)
    engine.generate(QUESTIONS[0], documents, max_new_tokens=2)
    assert engine.generate(QUESTIONS[1], documents, max_new_tokens=2).stats.draft_cached_tokens > 0


def test_a_mapped_draft_caches_its_own_rendering(tiny_model, tokenizer):
    draft_tokenizer = build_tokenizer(vocab_size=300)  # another vocabulary: the draft reads its own rendering
    other = build_model(draft_tokenizer, layers=1, max_positions=4096, seed=1)
    settings = dict(keep_rate=0.2, min_prompt_tokens=0, look_ahead=3, draft_tokenizer=draft_tokenizer)
    cached = SpecPrefillEngine.from_models(tiny_model, tokenizer, other, draft_cache_mb=9, **settings)
    cold = SpecPrefillEngine.from_models(tiny_model, tokenizer, other, draft_cache_mb=0, **settings)
    documents = random_documents(3, 80, seed=14)
    first, second = (cached.layout(question, documents) for question in QUESTIONS[:2])
    assert cached.draft_path == "mapped" and cached.select(first).draft_cached_tokens == 0
    draft_first, draft_second = (cached.draft_scoring.draft_layout(layout).input_ids for layout in (first, second))
    chosen = cached.select(second)
    assert chosen.draft_cached_tokens == common_prefix_length(draft_first, draft_second) > len(second) // 2
    assert torch.equal(chosen.kept, cold.select(second).kept)


def test_draft_cache_size_is_validated():
    with pytest.raises(ValidationError, match="draft_cache_mb"):
        SpecPrefillConfig(draft_cache_mb=-1)
    assert SpecPrefillConfig().draft_cache_mb > 0
