"""The in-process main model's prefix cache of sparse prompts: keyed by token ids AND positions, exact."""

import threading

import pytest
import torch

from specprefill_rag.backends.base import SparsePrompt
from specprefill_rag.backends.hf import MAIN_MIN_REUSE_SHARE, HFBackend, position_keyed
from specprefill_rag.config import GenerationParams
from specprefill_rag.kvcache.prefix_cache import PrefixKVCache
from specprefill_rag.results import PrefillReport

PARAMS = GenerationParams(max_new_tokens=12)


def ids(tokenizer, text):
    return torch.tensor(tokenizer(text)["input_ids"])


@pytest.fixture
def turns(tokenizer):
    """Turn 1's full prompt, and turn 2's: turn 1's prompt, its answer, and a follow-up."""
    first = ids(tokenizer, "Retrieval augmented generation feeds documents to a model. " * 6 + "the bridge opened in")
    return first


def kept_of(length, every=3):
    return torch.tensor(sorted(set(range(0, length, every)) | {length - 1}))


def run(backend, prompt, params=PARAMS):
    report = PrefillReport()
    tokens = list(backend.generate(prompt, params, report))
    return tokens, report.cached_tokens


def cache():
    return PrefixKVCache(64 * 2**20, MAIN_MIN_REUSE_SHARE)


def test_position_keyed_differs_by_id_or_position():
    keys = position_keyed(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0]))
    assert len(set(keys.tolist())) == 3
    assert torch.equal(keys, position_keyed(torch.tensor([5, 5, 6]), torch.tensor([0, 1, 0])))


@pytest.mark.parametrize("sparse", [False, True], ids=["keep-1.0", "sparse"])
def test_next_turn_reuses_the_last_turns_kv_and_answers_the_same(tiny_model, turns, sparse):
    """Turn 2 = turn 1's sparse prompt + its answer + new tokens: served from cache, same greedy tokens."""
    first = turns
    kept = kept_of(first.numel()) if sparse else torch.arange(first.numel())
    cached_backend, plain = HFBackend(tiny_model, frozenset(), prefix_cache=cache()), HFBackend(tiny_model, frozenset())
    prompt_1 = SparsePrompt.kept(first, kept)
    answer, hit = run(cached_backend, prompt_1)
    assert hit == 0 and answer == run(plain, prompt_1)[0]
    follow_up = torch.tensor([7, 8, 9, 10, 11])
    # the answer (all but its last token were fed back) sits at positions L, L+1, ...; the follow-up after it
    second = torch.cat([first, torch.tensor(answer), follow_up])
    kept_2 = torch.cat([kept, torch.arange(first.numel(), second.numel())])
    prompt_2 = SparsePrompt.kept(second, kept_2)
    tokens, served = run(cached_backend, prompt_2)
    assert served == kept.numel() + len(answer) - 1
    assert tokens == run(plain, prompt_2)[0]


def test_same_ids_at_other_positions_never_hit(tiny_model, turns):
    store = cache()
    backend = HFBackend(tiny_model, frozenset(), prefix_cache=store)
    kept = kept_of(turns.numel())
    run(backend, SparsePrompt.kept(turns, kept))
    shifted = SparsePrompt(turns[kept], kept + 1, turns.numel() + 1)  # same ids, every position one later
    tokens, served = run(backend, shifted)
    assert served == 0
    assert tokens == run(HFBackend(tiny_model, frozenset()), shifted)[0]
    renumbered = SparsePrompt.renumbered(turns, kept)  # positions 0..K-1: only the first token agrees
    assert run(backend, renumbered)[1] == 1


def test_a_shared_prefix_is_served_up_to_where_positions_diverge(tiny_model, turns):
    backend = HFBackend(tiny_model, frozenset(), prefix_cache=cache())
    length = turns.numel()
    run(backend, SparsePrompt.full(turns))
    kept = torch.cat([torch.arange(40), torch.arange(48, length)])  # drops 8 tokens after the first 40
    tokens, served = run(backend, SparsePrompt.kept(turns, kept))
    assert served == 40
    assert tokens == run(HFBackend(tiny_model, frozenset()), SparsePrompt.kept(turns, kept))[0]


def test_a_prompt_that_is_all_cached_still_computes_its_last_token(tiny_model, turns):
    backend = HFBackend(tiny_model, frozenset(), prefix_cache=cache())
    prompt = SparsePrompt.full(turns)
    first, _ = run(backend, prompt)
    again, served = run(backend, prompt)
    assert served == turns.numel() - 1 and again == first


def test_without_a_cache_nothing_is_reported_served(tiny_model, turns):
    assert run(HFBackend(tiny_model, frozenset()), SparsePrompt.full(turns))[1] == 0


def test_the_cache_stays_within_its_budget(tiny_model, turns):
    one_prompt = 2 * tiny_model.config.num_hidden_layers * turns.numel()  # keys + values per layer, tokens
    bytes_per_token = tiny_model.config.num_key_value_heads * (
        tiny_model.config.hidden_size // tiny_model.config.num_attention_heads
    )
    budget = int(one_prompt * bytes_per_token * 4 * 1.5)  # float32: room for one prompt, not two
    store = PrefixKVCache(budget, MAIN_MIN_REUSE_SHARE)
    backend = HFBackend(tiny_model, frozenset(), prefix_cache=store)
    for shift in range(3):
        run(backend, SparsePrompt(turns, torch.arange(turns.numel()) + shift, turns.numel() + shift))
        assert store.nbytes <= budget
    assert len(store) == 1


def test_early_close_stores_what_was_computed(tiny_model, turns):
    store = cache()
    backend = HFBackend(tiny_model, frozenset(), prefix_cache=store)
    generated = backend.generate(SparsePrompt.full(turns), PARAMS)
    next(generated)
    generated.close()
    assert len(store) == 1
    assert run(backend, SparsePrompt.full(turns))[1] == turns.numel() - 1


def test_concurrent_requests_over_one_cache_answer_as_alone(tiny_model, turns):
    backend = HFBackend(tiny_model, frozenset(), threading.RLock(), prefix_cache=cache())
    plain = HFBackend(tiny_model, frozenset())
    prompts = [SparsePrompt.kept(turns, kept_of(turns.numel(), every)) for every in (1, 2, 3, 2, 1, 3)]
    expected = [run(plain, p)[0] for p in prompts]
    results: list[list[int] | None] = [None] * len(prompts)

    def answer(index: int) -> None:
        results[index] = run(backend, prompts[index])[0]

    threads = [threading.Thread(target=answer, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert results == expected
