"""The draft cache's block index: lookups find exactly what a scan of every entry would, without the scan."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specprefill_rag.kvcache import prefix_cache as draft_cache
from specprefill_rag.kvcache.prefix_cache import DraftIdentity, PrefixKVCache, common_prefix_length
from specprefill_rag.kvcache.prefix_index import BLOCK_TOKENS, PrefixIndex, block_hashes


def fake_kv(token_ids, layers=1):
    keys = token_ids.float()[None, None, :, None]
    return tuple((keys.clone(), keys.clone()) for _ in range(layers))


def test_block_hashes_name_the_seed_and_the_leading_blocks():
    ids = torch.arange(3 * BLOCK_TOKENS + 5)
    hashes = block_hashes("draft", ids)
    assert len(hashes) == 4
    assert block_hashes("draft", ids[: 2 * BLOCK_TOKENS]) == hashes[:3]
    changed = ids.clone()
    changed[BLOCK_TOKENS + 1] = -7  # inside block 1: hashes 2 and 3 change, 0 and 1 do not
    other = block_hashes("draft", changed)
    assert other[:2] == hashes[:2] and not set(other[2:]) & set(hashes[2:])
    assert block_hashes("another draft", ids)[0] != hashes[0]


def test_removing_every_entry_leaves_the_index_empty():
    index = PrefixIndex()
    chains = [block_hashes(0, torch.arange(n)) for n in (5, 40, 40, 100)]
    for number, hashes in enumerate(chains):
        index.add(number, hashes)
    assert index.deepest(chains[3])[1] == {3}
    for number, hashes in enumerate(chains):
        index.remove(number, hashes)
    assert not index._through and not index._ending


token_lists = st.lists(st.integers(0, 2), min_size=1, max_size=70)  # 3 ids: long shared prefixes are common


@settings(max_examples=60, deadline=None)
@given(stored=st.lists(token_lists, min_size=1, max_size=12), asked=token_lists, share=st.sampled_from([0.0, 0.5]))
def test_lookup_finds_the_longest_prefix_a_scan_finds(tiny_model, stored, asked, share):
    draft = DraftIdentity.of(tiny_model, 1)
    cache = PrefixKVCache(2**30, min_reuse_share=share)
    kept = []
    for ids in map(torch.tensor, stored):
        cache.store(tiny_model, draft, ids, fake_kv(ids))
        kept = [k for k in kept if not (k.numel() <= ids.numel() and torch.equal(ids[: k.numel()], k))]
        if not any(k.numel() >= ids.numel() and torch.equal(k[: ids.numel()], ids) for k in kept):
            kept.append(ids)
    assert sorted(e.token_ids.tolist() for e in cache._entries.values()) == sorted(k.tolist() for k in kept)
    query = torch.tensor(asked)
    best = max(common_prefix_length(k, query) for k in kept)
    hit = cache.lookup(draft, query, query.numel())
    expected = best if best >= max(1, share * query.numel()) else None
    assert (hit.tokens if hit else None) == expected
    if hit is not None:
        assert torch.equal(hit.layers[0][0][0, 0, :, 0], query[: hit.tokens].float())


def test_a_lookup_compares_ids_only_with_entries_that_share_the_longest_prefix(tiny_model, monkeypatch):
    """Thousands of cached prompts that share a template: a new prompt is compared with none of them,
    and a follow-up question with only the prompt it follows (a scan compared with every entry)."""
    draft = DraftIdentity.of(tiny_model, 1)
    cache = PrefixKVCache(2**30)
    template = torch.arange(40)
    for number in range(2000):
        ids = torch.cat([template, torch.full((200,), 1000 + number)])
        cache.store(tiny_model, draft, ids, fake_kv(ids))
    compared = []
    real = draft_cache.common_prefix_length
    monkeypatch.setattr(draft_cache, "common_prefix_length", lambda a, b: compared.append(1) or real(a, b))
    assert cache.lookup(draft, torch.cat([template, torch.full((200,), 5)]), 239) is None
    assert compared == []
    follow_up = torch.cat([template, torch.full((200,), 1007), torch.tensor([1, 2, 3])])
    assert cache.lookup(draft, follow_up, 242).tokens == 240
    assert len(compared) == 1


@pytest.mark.parametrize("length", [BLOCK_TOKENS - 1, BLOCK_TOKENS, 2 * BLOCK_TOKENS + 1])
def test_prompts_around_a_block_boundary_hit_in_full(tiny_model, length):
    draft = DraftIdentity.of(tiny_model, 1)
    cache = PrefixKVCache(2**30)
    ids = torch.arange(length)
    cache.store(tiny_model, draft, ids, fake_kv(ids))
    assert cache.lookup(draft, torch.cat([ids, torch.tensor([-1])]), length).tokens == length
