"""vLLM's own block hasher (``get_request_block_hasher`` on real ``Request`` objects) with the plugin's
position keys, without an engine; tests/vllm_v2 runs the same checks on vLLM 0.33."""

import pytest
import torch
from vllm import SamplingParams

from specprefill_rag.backends.base import SparsePrompt
from specprefill_rag.backends.vllm import request_fields
from specprefill_rag.vllm_plugin.block_keys import position_keyed_blocks

SIZE = 16


@pytest.fixture(scope="module")
def hasher():
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    function = get_hash_fn_by_name("sha256")
    init_none_hash(function)
    with position_keyed_blocks() as installed:
        assert installed
        yield get_request_block_hasher(SIZE, function)


def hashes(hasher, prompt: SparsePrompt, salt: str | None = None, generated: int = 0) -> list:
    from vllm.v1.request import Request

    fields = request_fields(prompt, salt=False)
    params = SamplingParams(max_tokens=8, extra_args=fields.get("extra_args"))
    request = Request("r", fields["prompt_token_ids"], params, None, cache_salt=salt, block_hasher=hasher)
    for token in range(generated):
        request.append_output_token_ids(token + 3)
    return list(request.block_hashes)


def shared(a: list, b: list) -> int:
    """Leading blocks two requests share."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b)))


IDS = torch.randint(3, 400, (160,), generator=torch.Generator().manual_seed(3))
KEPT = torch.tensor([*range(40), *range(60, 100), *range(120, 160)])  # K = 120; first drop at index 40


def test_ordinary_and_compressed_share_the_blocks_before_the_first_dropped_token(hasher):
    plain, compressed = hashes(hasher, SparsePrompt.full(IDS)), hashes(hasher, SparsePrompt.kept(IDS, KEPT))
    assert len(compressed) == 120 // SIZE and shared(plain, compressed) == 40 // SIZE


def test_same_ids_at_other_positions_share_nothing_after_the_first_moved_block(hasher):
    moved = SparsePrompt(IDS[KEPT], torch.tensor([*range(40), *range(70, 110), *range(120, 160)]), 160)
    assert shared(hashes(hasher, SparsePrompt.kept(IDS, KEPT)), hashes(hasher, moved)) == 40 // SIZE
    shifted = SparsePrompt(IDS[KEPT], KEPT + 1, 161)
    assert shared(hashes(hasher, SparsePrompt.kept(IDS, KEPT)), hashes(hasher, shifted)) == 0


def test_a_later_turn_extends_the_earlier_turns_hashes(hasher):
    """Turn 2 = turn 1's prompt, its answer (generated at L1, L1+1, ...) and more: every turn-1 block hash recurs."""
    answer = [token + 3 for token in range(24)]  # what hashes(..., generated=24) appends
    turn1 = hashes(hasher, SparsePrompt.kept(IDS, KEPT), generated=24)  # 144 tokens: 9 blocks, 3 of the answer
    full2 = torch.cat([IDS, torch.tensor(answer), torch.randint(3, 400, (40,))])
    kept2 = torch.cat([KEPT, torch.arange(160, 184), torch.arange(200, 224)])
    turn2 = hashes(hasher, SparsePrompt.kept(full2, kept2))
    assert len(turn1) == 9 and turn2[:9] == turn1


def test_a_users_salt_is_kept(hasher):
    prompt = SparsePrompt.kept(IDS, KEPT)
    assert shared(hashes(hasher, prompt, salt="a"), hashes(hasher, prompt, salt="b")) == 0
    assert hashes(hasher, prompt, salt="a") == hashes(hasher, prompt, salt="a")
    assert shared(hashes(hasher, prompt, salt="a"), hashes(hasher, prompt)) == 0


def test_without_the_wrapper_positions_are_not_hashed(hasher):
    """What the wrapper prevents: vLLM alone gives the same ids at other positions the same hashes."""
    from vllm.v1.core import kv_cache_utils

    from specprefill_rag.vllm_plugin.block_keys import install_position_keyed_blocks, remove_position_keyed_blocks

    moved = SparsePrompt(IDS[KEPT], KEPT + 1, 161)
    remove_position_keyed_blocks()
    try:
        assert not hasattr(kv_cache_utils.generate_block_hash_extra_keys, "__specprefill_original__")
        assert hashes(hasher, moved) == hashes(hasher, SparsePrompt.kept(IDS, KEPT))
    finally:
        install_position_keyed_blocks()
    assert hashes(hasher, moved) != hashes(hasher, SparsePrompt.kept(IDS, KEPT))
