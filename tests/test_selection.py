import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specprefill_rag.selection import chunks_to_take, document_chunks, select_kept


def test_chunks_restart_at_each_document_and_skip_non_documents():
    document_index = torch.tensor([-1, 0, 0, 0, 0, 0, 1, 1, -1, 1, 1, 1])
    chunk_id = document_chunks(document_index, chunk_size=2)
    assert chunk_id.tolist() == [-1, 0, 0, 1, 1, 2, 3, 3, -1, 4, 4, 5]


@st.composite
def layouts(draw):
    """Random prompts: template/question runs (-1) interleaved with documents."""
    pieces = []
    n_documents = draw(st.integers(0, 5))
    pieces.append([-1] * draw(st.integers(1, 20)))
    for doc in range(n_documents):
        pieces.append([doc] * draw(st.integers(1, 120)))
        pieces.append([-1] * draw(st.integers(0, 6)))
    pieces.append([-1] * draw(st.integers(1, 10)))
    document_index = torch.tensor([i for piece in pieces for i in piece])
    seed = draw(st.integers(0, 2**16))
    importance = torch.rand(document_index.numel(), generator=torch.Generator().manual_seed(seed))
    keep_rate = draw(st.floats(0.01, 1.0))
    chunk_size = draw(st.sampled_from([1, 4, 32]))
    return importance, document_index, keep_rate, chunk_size


@settings(max_examples=150, deadline=None)
@given(layouts())
def test_selection_properties(case):
    importance, document_index, keep_rate, chunk_size = case
    kept = select_kept(importance, document_index, keep_rate=keep_rate, chunk_size=chunk_size)
    is_document = document_index >= 0
    # sorted, unique, in range
    assert torch.all(kept[1:] > kept[:-1])
    assert kept.min() >= 0 and kept.max() < document_index.numel()
    mask = torch.zeros_like(is_document)
    mask[kept] = True
    # non-document tokens (template, instructions, question) and the last token are always kept
    assert mask[~is_document].all()
    assert mask[-1]
    # budget met, overshooting by less than one chunk
    n_documents = int(is_document.sum())
    kept_documents = int(mask[is_document].sum())
    target = math.ceil(keep_rate * n_documents - 1e-9)
    assert kept_documents >= target
    assert kept_documents < target + chunk_size or kept_documents == n_documents
    # whole chunks: within each chunk, tokens are all kept or all dropped
    chunk_id = document_chunks(document_index, chunk_size)
    for chunk in chunk_id.unique().tolist():
        if chunk >= 0:
            members = mask[chunk_id == chunk]
            assert members.all() or not members.any()
            assert document_index[chunk_id == chunk].unique().numel() == 1  # a chunk never spans documents
    # deterministic
    again = select_kept(importance.clone(), document_index.clone(), keep_rate=keep_rate, chunk_size=chunk_size)
    assert torch.equal(kept, again)


def test_keeps_highest_scoring_chunks():
    document_index = torch.tensor([-1] + [0] * 8 + [1] * 8 + [-1])
    importance = torch.zeros(18)
    importance[13:17] = 1.0  # second half of document 1
    kept = select_kept(importance, document_index, keep_rate=0.25, chunk_size=4)
    assert kept.tolist() == [0, 13, 14, 15, 16, 17]


def test_max_document_tokens_is_a_hard_cap():
    document_index = torch.tensor([-1] + [0] * 100 + [-1])
    importance = torch.rand(102, generator=torch.Generator().manual_seed(0))
    kept = select_kept(importance, document_index, keep_rate=1.0, chunk_size=32, max_document_tokens=70)
    kept_documents = int((document_index[kept] >= 0).sum())
    assert 70 - 32 < kept_documents <= 70  # whole chunks in rank order while they fit under the cap


@pytest.mark.parametrize("keep_rate", [0.5, 1.0])
def test_full_keep_and_no_documents(keep_rate):
    kept = select_kept(torch.rand(5), torch.full((5,), -1), keep_rate=keep_rate, chunk_size=4)
    assert kept.tolist() == [0, 1, 2, 3, 4]
    kept = select_kept(torch.rand(40), torch.tensor([-1] + [0] * 38 + [-1]), keep_rate=1.0, chunk_size=4)
    assert kept.numel() == 40


def test_tie_break_prefers_earlier_chunk():
    document_index = torch.tensor([0] * 8 + [-1])
    kept = select_kept(torch.ones(9), document_index, keep_rate=0.5, chunk_size=4)
    assert kept.tolist() == [0, 1, 2, 3, 8]


def test_chunks_to_take_rounding():
    sizes = torch.tensor([32, 32, 32, 4])
    assert chunks_to_take(sizes, 100, 0.1, None) == 1  # 10 tokens -> one chunk
    assert chunks_to_take(sizes, 100, 0.33, None) == 2  # 33 tokens -> two chunks (64)
    assert chunks_to_take(sizes, 100, 1.0, None) == 4
    assert chunks_to_take(sizes, 100, 1.0, 31) == 0


def test_importance_mass_keeps_the_sharp_chunks_within_floor_and_ceiling():
    from specprefill_rag.selection import ImportanceMass

    document_index = torch.zeros(40, dtype=torch.long)  # one document of 10 chunks of 4
    flat = torch.full((40,), 0.1)
    sharp = flat.clone()
    sharp[8:12] = 0.9  # chunk 2 holds nearly all the mass above the background
    budget = ImportanceMass(share=0.8, floor=0.1, ceiling=0.6)
    kept_sharp = select_kept(sharp, document_index, keep_rate=budget, chunk_size=4)
    assert kept_sharp.tolist() == [*range(8, 12), 39]  # the sharp chunk (and the last token, always kept)
    kept_flat = select_kept(flat, document_index, keep_rate=budget, chunk_size=4)
    assert kept_flat.numel() - 1 == 4  # flat attention: the floor, 10% of 40 tokens = one chunk
    spread = torch.linspace(1.0, 0.0, 40)  # mass spread over many chunks: capped by the ceiling
    kept_spread = select_kept(spread, document_index, keep_rate=ImportanceMass(0.99, 0.1, 0.3), chunk_size=4)
    assert kept_spread.tolist() == [*range(12), 39]  # 30% of 40 = three chunks, the best ranked first ones


@settings(max_examples=100, deadline=None)
@given(layouts(), st.floats(0.05, 0.99), st.floats(0.0, 0.5), st.floats(0.5, 1.0))
def test_importance_mass_never_keeps_less_than_the_floor(case, share, floor, ceiling):
    from specprefill_rag.selection import ImportanceMass

    importance, document_index, _, chunk_size = case
    kept = select_kept(
        importance, document_index, keep_rate=ImportanceMass(share, floor, ceiling), chunk_size=chunk_size
    )
    n_documents = int((document_index >= 0).sum())
    kept_documents = int((document_index[kept] >= 0).sum())
    assert kept_documents >= math.ceil(floor * n_documents - 1e-9)
    assert kept_documents <= math.ceil(ceiling * n_documents - 1e-9) + chunk_size


def test_sentences_are_packed_whole_into_chunks_and_long_ones_are_cut():
    # document 0: sentences of 3, 2, 6 and 1 tokens; document 1: one sentence of 5
    document_index = torch.tensor([-1] + [0] * 12 + [-1] + [1] * 5)
    sentence_start = torch.zeros(19, dtype=torch.bool)
    sentence_start[[1, 4, 6, 12]] = True
    chunk_id = document_chunks(document_index, chunk_size=4, sentence_start=sentence_start)
    # 3 fits, 3+2 does not; the 6-token sentence is cut after 4 and its last 2 pack with the 1-token one
    assert chunk_id.tolist() == [-1, 0, 0, 0, 1, 1, 2, 2, 2, 2, 3, 3, 3, -1, 4, 4, 4, 4, 5]


@st.composite
def sentence_layouts(draw):
    importance, document_index, keep_rate, chunk_size = draw(layouts())
    starts = draw(st.lists(st.booleans(), min_size=document_index.numel(), max_size=document_index.numel()))
    return importance, document_index, keep_rate, chunk_size, torch.tensor(starts)


def sentences_of(document_index: torch.Tensor, sentence_start: torch.Tensor) -> list[list[int]]:
    """Each sentence's token positions: a run from a sentence or document start to the next such start."""
    sentences: list[list[int]] = []
    for position, document in enumerate(document_index.tolist()):
        if document < 0:
            continue
        new_run = position == 0 or document_index[position - 1] != document
        if new_run or sentence_start[position]:
            sentences.append([])
        sentences[-1].append(position)
    return sentences


@settings(max_examples=150, deadline=None)
@given(sentence_layouts())
def test_sentence_chunks_never_cut_a_sentence_that_fits(case):
    importance, document_index, keep_rate, chunk_size, sentence_start = case
    chunk_id = document_chunks(document_index, chunk_size, sentence_start)
    fixed = document_chunks(document_index, chunk_size)
    assert torch.equal(chunk_id >= 0, fixed >= 0)
    sizes = torch.bincount(chunk_id[chunk_id >= 0])
    assert sizes.numel() == 0 or int(sizes.max()) <= chunk_size
    for chunk in chunk_id.unique().tolist():
        if chunk >= 0:
            assert document_index[chunk_id == chunk].unique().numel() == 1
            members = torch.nonzero(chunk_id == chunk).flatten()
            assert int(members[-1] - members[0]) + 1 == members.numel()  # contiguous
    for sentence in sentences_of(document_index, sentence_start):
        if len(sentence) <= chunk_size:
            assert chunk_id[sentence].unique().numel() == 1
    kept = select_kept(importance, document_index, keep_rate=keep_rate, chunk_size=chunk_size,
                       sentence_start=sentence_start)  # fmt: skip
    mask = torch.zeros_like(sentence_start)
    mask[kept] = True
    for chunk in chunk_id.unique().tolist():
        if chunk >= 0:
            assert mask[chunk_id == chunk].all() or not mask[chunk_id == chunk].any()


def test_a_start_at_every_token_is_the_fixed_chunking():
    document_index = torch.tensor([-1] * 3 + [0] * 70 + [-1] + [1] * 40 + [2] * 9)
    every = torch.ones(document_index.numel(), dtype=torch.bool)
    assert torch.equal(document_chunks(document_index, 32, every), document_chunks(document_index, 32))
