"""Sparse prefill with original positions on the transformers backend."""

import torch

from specprefill_rag.backends.base import SparsePrompt
from specprefill_rag.backends.hf import HFBackend
from specprefill_rag.config import GenerationParams
from specprefill_rag.decode.sampling import apply_penalties


def prompt_ids(tokenizer):
    text = "Retrieval augmented generation feeds documents to a language model. " * 8 + "the bridge opened in"
    return torch.tensor(tokenizer(text)["input_ids"])


def test_keep_all_greedy_equals_generate(tokenizer, tiny_model):
    input_ids = prompt_ids(tokenizer)
    params = GenerationParams(max_new_tokens=20)
    tokens = list(HFBackend(tiny_model, frozenset()).generate(SparsePrompt.full(input_ids), params))
    with torch.no_grad():
        expected = tiny_model.generate(input_ids[None], max_new_tokens=20, do_sample=False, eos_token_id=None)
    assert tokens == expected[0, input_ids.numel() :].tolist()


def test_sparse_prefill_equals_masked_full_forward(tokenizer, tiny_model):
    """Kept tokens at original positions == full forward where every token sees only kept tokens."""
    input_ids = prompt_ids(tokenizer)
    length = input_ids.numel()
    kept = torch.tensor(sorted(set(range(0, length, 3)) | {length - 1}))
    visible = torch.zeros(length, dtype=torch.bool)
    visible[kept] = True
    allowed = torch.tril(torch.ones(length, length, dtype=torch.bool)) & visible[None, :]
    allowed |= torch.eye(length, dtype=torch.bool)  # dropped rows attend to themselves; their outputs are unused
    mask = torch.zeros(length, length).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
    with torch.no_grad():
        reference = tiny_model(input_ids[None], attention_mask=mask, position_ids=torch.arange(length)[None]).logits
    from transformers import DynamicCache

    hf = HFBackend(tiny_model, frozenset())
    with torch.no_grad():
        sparse = tiny_model(
            input_ids[kept][None], position_ids=kept[None], past_key_values=DynamicCache(config=tiny_model.config)
        ).logits
    torch.testing.assert_close(sparse[0], reference[0, kept], atol=1e-4, rtol=1e-4)
    last = hf._forward(input_ids[kept], kept, 0, DynamicCache(config=tiny_model.config))
    torch.testing.assert_close(last, reference[0, -1], atol=1e-4, rtol=1e-4)


def test_sparse_prefill_equals_explicit_position_forward(tokenizer, tiny_model):
    input_ids = prompt_ids(tokenizer)
    kept = torch.tensor([0, 1, 2, 5, 6, 9, 12, 13, 14, input_ids.numel() - 1])
    with torch.no_grad():
        reference = tiny_model(
            input_ids[kept][None], position_ids=kept[None], attention_mask=torch.ones(1, kept.numel(), dtype=torch.long)
        ).logits[0, -1]
        contiguous = tiny_model(input_ids[kept][None]).logits[0, -1]
    from transformers import DynamicCache

    got = HFBackend(tiny_model, frozenset())._forward(input_ids[kept], kept, 0, DynamicCache(config=tiny_model.config))
    torch.testing.assert_close(got, reference, atol=1e-4, rtol=1e-4)
    assert not torch.allclose(got, contiguous, atol=1e-3)  # positions matter: renumbering gives other logits


def test_decode_positions_continue_at_prompt_length(tokenizer, tiny_model):
    input_ids = prompt_ids(tokenizer)
    length = input_ids.numel()
    kept = torch.arange(0, length, 2)
    kept = torch.cat([kept, torch.tensor([length - 1])]) if kept[-1] != length - 1 else kept
    seen = []

    def record(_module, _args, kwargs):
        seen.append((kwargs["position_ids"].flatten().tolist(), kwargs["cache_position"].flatten().tolist()))

    handle = tiny_model.register_forward_pre_hook(record, with_kwargs=True)
    try:
        list(
            HFBackend(tiny_model, frozenset()).generate(
                SparsePrompt.kept(input_ids, kept), GenerationParams(max_new_tokens=4)
            )
        )
    finally:
        handle.remove()
    assert seen[0] == (kept.tolist(), list(range(kept.numel())))
    assert [s[0] for s in seen[1:]] == [[length], [length + 1], [length + 2]]
    assert [s[1] for s in seen[1:]] == [[kept.numel()], [kept.numel() + 1], [kept.numel() + 2]]


def test_sampling_is_reproducible_with_seed(tokenizer, tiny_model):
    prompt = SparsePrompt.full(prompt_ids(tokenizer))
    hf = HFBackend(tiny_model, frozenset())
    params = GenerationParams(max_new_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    first, second = list(hf.generate(prompt, params)), list(hf.generate(prompt, params))
    other = list(hf.generate(prompt, params.model_copy(update={"seed": 8})))
    assert first == second
    assert first != other


def test_stops_at_eos_without_yielding_it(tokenizer, tiny_model):
    prompt = SparsePrompt.full(prompt_ids(tokenizer))
    greedy = list(HFBackend(tiny_model, frozenset()).generate(prompt, GenerationParams(max_new_tokens=6)))
    stopped = list(HFBackend(tiny_model, frozenset({greedy[2]})).generate(prompt, GenerationParams(max_new_tokens=6)))
    assert stopped == greedy[: greedy.index(greedy[2])]


def test_penalties_subtract_presence_once_and_frequency_per_occurrence():
    logits = apply_penalties(torch.zeros(4), torch.tensor([0.0, 1.0, 3.0, 0.0]), presence=0.5, frequency=0.25)
    assert logits.tolist() == [0.0, -0.75, -1.25, 0.0]


def test_a_frequency_penalty_breaks_greedy_repetition(tiny_model, tokenizer):
    prompt = SparsePrompt.full(torch.tensor(tokenizer.encode("the bridge the bridge the bridge")))
    plain = list(HFBackend(tiny_model, frozenset()).generate(prompt, GenerationParams(max_new_tokens=16)))
    assert len(set(plain)) < len(plain), "the check needs an unpenalised answer that repeats a token"
    penalised = GenerationParams(max_new_tokens=16, frequency_penalty=2.0, presence_penalty=2.0)
    varied = list(HFBackend(tiny_model, frozenset()).generate(prompt, penalised))
    assert varied != plain and len(set(varied)) > len(set(plain))
