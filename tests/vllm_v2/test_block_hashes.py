"""The position-keyed block hashes on vLLM 0.33's own block hasher (the checks of tests/vllm/test_block_hashes.py)."""

from tests.vllm.test_block_hashes import (  # noqa: F401  (collected here too)
    hasher,
    test_a_later_turn_extends_the_earlier_turns_hashes,
    test_a_users_salt_is_kept,
    test_ordinary_and_compressed_share_the_blocks_before_the_first_dropped_token,
    test_same_ids_at_other_positions_share_nothing_after_the_first_moved_block,
    test_without_the_wrapper_positions_are_not_hashed,
)
