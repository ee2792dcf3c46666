"""Kept-position codec, validation, salt and map (no vLLM needed)."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.positions import cache_salt, decode_runs, encode_runs, original_positions, validate


@given(st.sets(st.integers(0, 500), min_size=1))
def test_runs_round_trip(positions):
    kept = torch.tensor(sorted(positions))
    runs = encode_runs(kept)
    assert torch.equal(decode_runs(runs), kept)
    assert len(runs) // 2 == 1 + int((kept[1:] != kept[:-1] + 1).sum())


def test_runs_are_compact():
    assert encode_runs([0, 1, 2, 3, 10, 11, 40]) == [0, 4, 10, 2, 40, 1]


@pytest.mark.parametrize(
    "runs, match",
    [
        ([0, 4, 2], "pairs"),
        ([0, 0], "lengths > 0"),
        ([-1, 2], "starts must be >= 0"),
        ([5, 2, 3, 1], "increasing"),
        ([0, 2, 1, 2], "increasing"),
        ([0, "2"], "integer"),
    ],
)
def test_malformed_runs(runs, match):
    with pytest.raises(InvalidRequestError, match=match):
        decode_runs(runs)


def test_validate():
    kept = torch.tensor([0, 1, 5, 9])
    validate(10, kept, 4, 5, 32)
    with pytest.raises(InvalidRequestError, match="must match"):
        validate(10, kept, 5, 5, 32)
    with pytest.raises(InvalidRequestError, match="last prompt token"):
        validate(12, kept, 4, 5, 32)
    with pytest.raises(InvalidRequestError, match="exceeds the model's 32 positions"):
        validate(10, kept, 4, 30, 32)


def test_salt_depends_on_positions_and_length():
    assert cache_salt(10, [0, 4]) == cache_salt(10, [0, 4])
    assert len({cache_salt(10, [0, 4]), cache_salt(11, [0, 4]), cache_salt(10, [1, 4])}) == 3
    assert len(cache_salt(10, [0, 4])) == 64


def test_position_map_prompt_then_decode():
    kept = torch.tensor([0, 1, 3, 6, 7])  # the paper's example: L = 10
    compact = torch.arange(8)  # 5 prompt tokens, then 3 generated
    assert original_positions(compact, kept, 10).tolist() == [0, 1, 3, 6, 7, 10, 11, 12]
    assert original_positions(torch.tensor([6, 2]), kept, 10).tolist() == [11, 3]  # chunked / out of order
