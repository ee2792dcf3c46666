"""Every cache that outlives a request is namespaced (issue #43 item 6): an entry stored in one namespace (a
gateway tenant) is never found from another, and None, the engine's own namespace, behaves as before."""

import asyncio

import pytest
import torch

from specprefill_rag.backends.base import SparsePrompt
from specprefill_rag.backends.hf import MAIN_MIN_REUSE_SHARE, HFBackend
from specprefill_rag.backends.vllm import request_fields
from specprefill_rag.config import GenerationParams
from specprefill_rag.draft.assembly import DocumentSpans
from specprefill_rag.draft.document_cache import DocumentKVCache, Held
from specprefill_rag.draft.importance import DraftScore
from specprefill_rag.draft.model import LayerPrefixDraft, ModelDraft
from specprefill_rag.engine import SpecPrefillEngine
from specprefill_rag.kvcache.prefix_cache import DraftIdentity, PrefixKVCache
from specprefill_rag.positions import cache_salt, encode_runs, namespace_salt
from specprefill_rag.prompt.layout import document_runs
from specprefill_rag.request import RequestOptions
from specprefill_rag.results import PrefillReport
from specprefill_rag.selection.memo import SelectionMemo
from specprefill_rag.serve.queue import DraftQueue
from specprefill_rag.testing import random_documents

NAMESPACES = [None, "tenant-a", "tenant-b"]


def others(namespace):
    return [other for other in NAMESPACES if other != namespace]


@pytest.fixture(scope="module")
def engine(tiny_model, tokenizer, tiny_draft):
    return SpecPrefillEngine.from_models(tiny_model, tokenizer, tiny_draft, min_prompt_tokens=0, look_ahead=2)


@pytest.fixture(scope="module")
def layout(engine):
    return engine.layout("When did the bridge open?", random_documents(2, 60, seed=431), "Answer briefly.")


def spans_of(layout):
    return DocumentSpans(document_runs(layout.document_index))


# -- the draft prefix cache ------------------------------------------------------------------------


def test_a_prefix_cache_entry_is_found_in_its_namespace_only():
    model = torch.nn.Linear(1, 1)  # held: its entries go when it is collected
    cache, draft = PrefixKVCache(2**24), DraftIdentity.of(model, 1)
    ids = torch.arange(40)
    layers = ((torch.zeros(1, 1, 40, 4), torch.zeros(1, 1, 40, 4)),)
    cache.store(model, draft, ids, layers, "tenant-a")
    assert cache.lookup(draft, ids, 39, "tenant-a").tokens == 39
    assert all(cache.lookup(draft, ids, 39, other) is None for other in others("tenant-a"))
    cache.store(model, draft, ids, layers, "tenant-b")  # the same ids, another tenant: kept apart
    assert len(cache) == 2 and cache.lookup(draft, ids, 39) is None


@pytest.mark.parametrize("kind", ["model", "self"])
@pytest.mark.parametrize("namespace", NAMESPACES)
def test_a_draft_reuses_the_prefix_its_own_namespace_scored(tiny_model, layout, kind, namespace):
    cache = PrefixKVCache(2**26)
    draft = (
        ModelDraft(tiny_model, 2, prefix_cache=cache)
        if kind == "model"
        else LayerPrefixDraft(tiny_model, 1, 13, 2, prefix_cache=cache)
    )
    assert draft.score_prompt(layout.input_ids, namespace=namespace).cached_tokens == 0
    for other in others(namespace):
        assert draft.score_prompt(layout.input_ids, namespace=other).cached_tokens == 0
    assert draft.score_prompt(layout.input_ids, namespace=namespace).cached_tokens > 0


def test_a_batch_looks_each_prompt_up_in_its_own_namespace(tiny_model, layout):
    draft = ModelDraft(tiny_model, 2, prefix_cache=PrefixKVCache(2**26))
    draft.score_prompt(layout.input_ids, namespace="tenant-a")
    rows = draft.score_batch([layout.input_ids] * 3, None, ["tenant-a", "tenant-b", None])
    assert [row.cached_tokens for row in rows][1:] == [0, 0] and rows[0].cached_tokens > 0


# -- the per-document draft cache ------------------------------------------------------------------


def test_documents_warmed_in_one_namespace_serve_only_it(tiny_model, layout):
    store = DocumentKVCache(2**26)
    draft = ModelDraft(tiny_model, 2, document_cache=store)
    assert draft.warm(layout.input_ids, spans_of(layout), "tenant-a") == 2
    held = store.held("tenant-a")
    assert held.entries == 3 and held.nbytes == store.nbytes  # two documents and their prefix
    assert store.held("tenant-b") == Held(0, 0) and store.held(None) == Held(0, 0)
    assert draft.score_prompt(layout.input_ids, spans_of(layout), "tenant-b").documents_cached == 0
    assert draft.score_prompt(layout.input_ids, spans_of(layout), "tenant-a").documents_cached == 2
    assert store.held("tenant-b").entries == 3 and len(store) == 6  # tenant-b's own copies, in one budget


def test_warm_counts_what_the_namespace_holds(tiny_model, layout):
    draft = ModelDraft(tiny_model, 2, document_cache=DocumentKVCache(2**26))
    draft.warm(layout.input_ids, spans_of(layout), "tenant-a")
    assert draft.warm(layout.input_ids, spans_of(layout), "tenant-a") == 2


# -- the selection memo ----------------------------------------------------------------------------


def recall(memo, ids, index, namespace):
    return memo.recall(torch.tensor(ids), torch.tensor(index), "settings", namespace)


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_the_memo_recalls_a_prompt_of_the_same_namespace_only(namespace):
    memo = SelectionMemo()
    ids, index = [1, 2, 3, 4, 5, 6, 7], [-1, 0, 0, 0, -1, 1, 1]
    memo.remember(recall(memo, ids, index, namespace), torch.tensor([0, 2, 4, 6]))
    for other in others(namespace):
        assert recall(memo, ids + [8], index + [-1], other).reused == 0
    assert recall(memo, ids + [8], index + [-1], namespace).complete


def test_the_same_prompt_in_two_namespaces_is_remembered_twice():
    memo = SelectionMemo()
    ids, index = [1, 2, 3, 4], [-1, 0, 0, -1]
    for namespace in ("tenant-a", "tenant-b"):
        memo.remember(recall(memo, ids, index, namespace), torch.tensor([0, 1, 3]))
    assert len(memo) == 2


# -- the in-process main model's prefix cache ------------------------------------------------------


def main_cached(backend, prompt):
    report = PrefillReport()
    list(backend.generate(prompt, GenerationParams(max_new_tokens=3), report))
    return report.cached_tokens


@pytest.mark.parametrize("namespace", NAMESPACES)
def test_the_main_model_reuses_kv_of_its_namespace_only(tiny_model, layout, namespace):
    backend = HFBackend(tiny_model, frozenset(), prefix_cache=PrefixKVCache(2**26, MAIN_MIN_REUSE_SHARE))
    kept = torch.arange(0, len(layout), 2)
    assert main_cached(backend, SparsePrompt.kept(layout.input_ids, kept, namespace)) == 0
    for other in others(namespace):
        assert main_cached(backend, SparsePrompt.kept(layout.input_ids, kept, other)) == 0
    assert main_cached(backend, SparsePrompt.kept(layout.input_ids, kept, namespace)) > 0


# -- the engine: None is today's shared namespace --------------------------------------------------


def test_engine_selection_takes_a_tenant_and_defaults_to_the_shared_namespace(engine, layout):
    engine.draft.prefix_cache.clear()
    assert engine.select(layout, 0.3).draft_cached_tokens == 0
    assert engine.select(layout, 0.3, tenant="tenant-a").draft_cached_tokens == 0
    assert engine.select(layout, 0.3).draft_cached_tokens > 0  # the engine API, no tenant: as before
    assert engine.select(layout, 0.3, tenant="tenant-a").draft_cached_tokens > 0
    prompt = engine.sparse_prompt(layout, torch.arange(len(layout)), RequestOptions(tenant="tenant-a"))
    assert prompt.namespace == "tenant-a" and engine.sparse_prompt(layout, torch.arange(3)).namespace is None


# -- a vLLM main: the namespace is vLLM's cache_salt -----------------------------------------------


def test_a_vllm_request_carries_its_namespaces_salt():
    ids, kept = torch.arange(40), torch.arange(0, 40, 3)
    whole, sparse = SparsePrompt.full(ids, "tenant-a"), SparsePrompt.kept(ids, torch.cat([kept, torch.tensor([39])]))
    assert request_fields(whole, salt=False)["cache_salt"] == namespace_salt("tenant-a")
    assert request_fields(whole)["cache_salt"] == namespace_salt("tenant-a")
    assert "cache_salt" not in request_fields(SparsePrompt.full(ids))  # no namespace: as before
    assert "cache_salt" not in request_fields(sparse, salt=False)  # position-keyed blocks, no namespace
    tenant_sparse = SparsePrompt(sparse.token_ids, sparse.position_ids, sparse.prompt_length, "tenant-a")
    keyed = request_fields(tenant_sparse, salt=False)  # position-keyed blocks: the salt joins block 0's keys
    assert keyed["cache_salt"] == namespace_salt("tenant-a") and "extra_args" in keyed
    runs = encode_runs(sparse.position_ids)
    salted = {request_fields(tenant_sparse)["cache_salt"], cache_salt(40, runs), cache_salt(40, runs, "tenant-b")}
    assert len(salted) == 3 and request_fields(sparse)["cache_salt"] == cache_salt(40, runs)
    assert namespace_salt("tenant-a") != namespace_salt("tenant-b") and "tenant-a" not in namespace_salt("tenant-a")


# -- the gateway's draft queue ---------------------------------------------------------------------


def test_the_draft_queue_hands_each_prompts_namespace_to_the_batch():
    calls = []

    def score_batch(prompts, documents=None, namespaces=None):
        calls.append(namespaces)
        return [DraftScore(torch.ones(p.numel())) for p in prompts]

    async def run():
        queue = DraftQueue(score_batch, capacity=8, batch_size=4, batch_tokens=10_000, window_s=0.01)
        try:
            return await asyncio.gather(queue.score(torch.arange(5), None, "tenant-a"), queue.score(torch.arange(6)))
        finally:
            await queue.stop()

    asyncio.run(run())
    assert calls == [["tenant-a", None]]
