"""Position keys of prefix-cache blocks (positions.BlockPositions, the plugin's wrapper logic); no vLLM needed."""

import time
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.positions import (
    BLOCK_KEY_TAG,
    PROMPT_LENGTH_KEY,
    RUNS_KEY,
    BlockPositions,
    encode_runs,
    original_positions,
)
from specprefill_rag.vllm_plugin.block_keys import _make_wrapper, request_block_positions


def positions_of(kept: list[int], length: int, start: int, end: int) -> list[int]:
    return original_positions(torch.arange(start, end), torch.tensor(kept), length).tolist()


def blocks(kept: list[int], length: int, size: int, total: int) -> list[tuple[int, ...] | None]:
    spec = BlockPositions(length, encode_runs(kept))
    return [spec.key(start, start + size) for start in range(0, total - size + 1, size)]


@st.composite
def requests(draw):
    length = draw(st.integers(2, 200))
    kept = sorted(draw(st.sets(st.integers(0, length - 2), max_size=length - 1)) | {length - 1})
    return kept, length


@settings(max_examples=200, deadline=None)
@given(requests(), requests(), st.integers(1, 40), st.integers(0, 300))
def test_keys_equal_exactly_when_positions_do(first, second, size, start):
    """Against the position map itself: None iff positions are the indices; equal keys iff equal positions."""
    keys, expected = [], []
    for kept, length in (first, second):
        keys.append(BlockPositions(length, encode_runs(kept)).key(start, start + size))
        expected.append(positions_of(kept, length, start, start + size))
        assert (keys[-1] is None) == (expected[-1] == list(range(start, start + size)))
    assert (keys[0] == keys[1]) == (expected[0] == expected[1])


@settings(max_examples=200, deadline=None)
@given(requests(), st.sets(st.integers(1, 100), min_size=1), st.integers(1, 40), st.integers(0, 300))
def test_a_later_turn_keys_like_the_earlier_one_where_positions_agree(first, added, size, start):
    kept, length = first
    later = [*kept, *(length + a for a in sorted(added))]  # turn t+1: turn t's prompt, then more
    later_length = later[-1] + 1
    key = BlockPositions(length, encode_runs(kept)).key(start, start + size)
    later_key = BlockPositions(later_length, encode_runs(later)).key(start, start + size)
    same = positions_of(kept, length, start, start + size) == positions_of(later, later_length, start, start + size)
    assert (key == later_key) == same
    if start + size <= len(kept):
        assert same


def test_key_spells_out_the_positions():
    spec = BlockPositions(10, encode_runs([0, 1, 3, 6, 7]))  # the paper's example: K = 5, L = 10
    assert spec.identity_end == 2
    assert spec.key(0, 2) is None  # positions 0, 1: an ordinary request's block
    assert spec.key(0, 4) == (0, 0, 2, 3, 3, 6)  # 0 1 | 3 | 6 ...
    assert spec.key(4, 8) == (0, 7, 1, 10)  # 7 | 10 11 12 (generated tokens from L = 10)
    assert spec.key(8, 12) == (0, 13)
    assert BlockPositions(6, [0, 6]).identity_end is None and BlockPositions(6, [0, 6]).key(0, 64) is None
    assert BlockPositions(6, [1, 5]).identity_end == 0


def test_adjacent_runs_key_like_one_run():
    assert BlockPositions(20, [0, 4, 4, 4, 12, 8]).key(0, 16) == BlockPositions(20, [0, 8, 12, 8]).key(0, 16)


def test_a_conversation_shares_the_earlier_turns_blocks():
    """Turn 2's full prompt extends turn 1's; its kept positions extend turn 1's: same keys up to turn 1's K."""
    instructions = list(range(40))
    turn1 = [*instructions, *range(60, 90), *range(120, 150)]  # L1 = 150, K1 = 100
    turn2 = [*turn1, *range(170, 200), *range(230, 260)]  # L2 = 260
    size = 16
    one, two = blocks(turn1, 150, size, 96), blocks(turn2, 260, size, 256)
    assert two[: len(one)] == one  # the 6 blocks inside turn 1's 100 kept tokens
    assert one[:2] == [None, None]  # positions 0..31: ordinary blocks
    assert one[2] is not None  # 32..47: kept 32..39, then 60..67
    plain = blocks(list(range(150)), 150, size, 96)
    assert plain == [None] * 6


def test_same_ids_at_other_positions_differ_from_the_first_moved_block():
    a = blocks([*range(8), *range(32, 48), *range(80, 96)], 96, 8, 40)
    b = blocks([*range(8), *range(40, 56), *range(80, 96)], 96, 8, 40)
    assert a[0] is None and b[0] is None and a[1] != b[1]


def test_cost_does_not_grow_with_the_runs_outside_the_block():
    kept = list(range(0, 200_000, 2))  # 100,000 runs of one position
    spec = BlockPositions(200_000, encode_runs(kept))
    started = time.perf_counter()
    keys = [spec.key(start, start + 16) for start in range(0, 99_000, 16)]
    assert time.perf_counter() - started < 2.0
    assert keys[10] == tuple(v for i in range(16) for v in (i, 2 * (160 + i)))


def test_malformed_runs_raise():
    with pytest.raises(InvalidRequestError, match="increasing"):
        BlockPositions(10, [5, 2, 3, 1])


def fake_original(request, start, end, mm_index):
    """vLLM's function's shape: (extra keys or None, next multimodal index)."""
    salt = getattr(request, "cache_salt", None)
    return ((("cache_salt", salt),) if salt and start == 0 else None), mm_index + 1


def request(extra_args=None, cache_salt=None):
    return SimpleNamespace(sampling_params=SimpleNamespace(extra_args=extra_args), cache_salt=cache_salt)


SPEC = {PROMPT_LENGTH_KEY: 10, RUNS_KEY: [0, 2, 3, 1, 6, 2]}


def test_wrapper_adds_positions_and_keeps_vllms_keys():
    wrapped = _make_wrapper(fake_original)
    assert wrapped(request(), 0, 4, 0) == (None, 1)  # ordinary request: vLLM's own keys
    assert wrapped(request(SPEC), 0, 2, 0) == (None, 1)  # kept 0, 1: an ordinary block
    assert wrapped(request(SPEC), 0, 4, 0) == (((BLOCK_KEY_TAG, (0, 0, 2, 3, 3, 6)),), 1)
    salted = wrapped(request(SPEC, cache_salt="user"), 0, 4, 3)
    assert salted == ((("cache_salt", "user"), (BLOCK_KEY_TAG, (0, 0, 2, 3, 3, 6))), 4)
    assert wrapped.__wrapped__ is fake_original


def test_runs_are_parsed_once_per_request():
    one = request(SPEC)
    parsed = request_block_positions(one)
    one.sampling_params.extra_args = None  # a second call must not parse again
    assert request_block_positions(one) is parsed
    plain = request()
    assert request_block_positions(plain) is None and request_block_positions(plain) is None


def test_unparsable_arguments_never_share_with_other_positions():
    wrapped = _make_wrapper(fake_original)
    bad = {PROMPT_LENGTH_KEY: 10, RUNS_KEY: [5, 2, 3, 1]}
    keys = wrapped(request(bad), 0, 4, 0)[0]
    assert keys is not None and keys[0][0] == BLOCK_KEY_TAG
    assert keys != wrapped(request({**bad, RUNS_KEY: [5, 2, 3, 2]}), 0, 4, 0)[0]
