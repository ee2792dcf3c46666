"""vLLM's prefix cache with position-keyed blocks, on the CPU build (the shared in-process engine: 128-token
blocks, 16-token prefill chunks).

A conversation's turn 2 (turn 1's prompt, its answer, then more) hits turn 1's blocks, shown by the
request's ``num_cached_tokens`` and vLLM's ``vllm:prefix_cache_hits`` counter, and its greedy tokens are
those of the same request with the prefix cache not read, and of the transformers backend. The same
ids at other positions never hit; an ordinary request and a compressed one share exactly the blocks
before the first dropped token; a user's own ``cache_salt`` still separates requests.
"""

import pytest
import torch

from specprefill_rag.backends.base import SparsePrompt
from specprefill_rag.backends.hf import HFBackend
from specprefill_rag.backends.vllm import VLLMOfflineBackend, keys_blocks_in_process, request_fields
from specprefill_rag.config import GenerationParams
from specprefill_rag.results import PrefillReport

BLOCK = 128  # vLLM's CPU default block size (the shared engine does not set one)
INSTRUCTIONS = 200  # leading tokens every turn keeps verbatim


@pytest.fixture(scope="module")
def hf_model(tiny_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32, attn_implementation="sdpa").eval()


def random_ids(seed: int, n: int) -> torch.Tensor:
    return torch.randint(3, 400, (n,), generator=torch.Generator().manual_seed(seed))


def hits(llm) -> int:
    return int(sum(m.value for m in llm.get_metrics() if m.name == "vllm:prefix_cache_hits"))


def run(llm, prompt: SparsePrompt, max_tokens: int, salt: str | None = None, read_cache: bool = True):
    """Greedy tokens (EOS ignored) and ``num_cached_tokens`` of one request, as the backend sends it."""
    from vllm import SamplingParams

    fields = request_fields(prompt, salt=False)
    if salt is not None:
        fields["cache_salt"] = salt
    params = SamplingParams(
        max_tokens=max_tokens,
        temperature=0,
        ignore_eos=True,
        detokenize=False,
        extra_args=fields.pop("extra_args", None),
        skip_reading_prefix_cache=not read_cache,
    )
    output = llm.generate([fields], params, use_tqdm=False)[0]
    return list(output.outputs[0].token_ids), output.num_cached_tokens


def reference(model, prompt: SparsePrompt, max_tokens: int) -> list[int]:
    return list(HFBackend(model, frozenset()).generate(prompt, GenerationParams(max_new_tokens=max_tokens)))


def test_the_plugin_keys_blocks_in_this_process(llm):  # vLLM loaded the plugin when it built the engine
    assert keys_blocks_in_process()  # so VLLMOfflineBackend sends no whole-request cache_salt
    sparse = SparsePrompt(torch.tensor([5, 6, 7]), torch.tensor([0, 4, 9]), 10)
    assert "cache_salt" not in request_fields(sparse, salt=not keys_blocks_in_process())


def test_turn_two_hits_turn_ones_blocks_and_answers_the_same(llm, hf_model):
    full1 = random_ids(11, 400)  # turn 1's whole prompt: L1 = 400
    kept1 = torch.tensor([*range(INSTRUCTIONS), *range(250, 300), *range(350, 400)])  # K1 = 300
    turn1 = SparsePrompt.kept(full1, kept1)
    answer, cached = run(llm, turn1, 90)
    assert len(answer) == 90 and cached == 0
    # turn 2: turn 1's prompt, its answer (at positions L1, L1+1, ..., where it was generated), a new message
    full2 = torch.cat([full1, torch.tensor(answer), random_ids(12, 200)])  # L2 = 690
    kept2 = torch.cat([kept1, torch.arange(400, 490), torch.arange(540, 690)])  # K2 = 540
    turn2 = SparsePrompt.kept(full2, kept2)
    before = hits(llm)
    backend, report2 = VLLMOfflineBackend(llm, frozenset()), PrefillReport()
    tokens = list(backend.generate(turn2, GenerationParams(max_new_tokens=8), report2))
    # turn 1's 389 computed tokens fill 3 blocks: its kept tokens and the first 84 of its answer
    assert report2.cached_tokens == 3 * BLOCK
    assert hits(llm) - before == 3 * BLOCK  # vLLM's own counter
    uncached, cached = run(llm, turn2, 8, read_cache=False)
    assert cached == 0 and tokens == uncached == reference(hf_model, turn2, 8)
    again, cached = run(llm, turn2, 8)  # the whole of turn 2 is cached now, but for the last block
    assert cached == 4 * BLOCK and again == tokens


def test_same_ids_at_other_positions_never_hit(llm, hf_model):
    full = random_ids(13, 400)
    kept = torch.tensor([*range(INSTRUCTIONS), *range(250, 300), *range(350, 400)])
    first = SparsePrompt.kept(full, kept)
    assert run(llm, first, 4)[1] == 0
    assert run(llm, first, 4)[1] == 2 * BLOCK  # the same request again: its 2 full prompt blocks
    shifted = SparsePrompt(first.token_ids, kept + 5, 405)  # every position moved: block 0 already differs
    regapped_kept = torch.tensor([*range(INSTRUCTIONS), *range(260, 310), *range(350, 400)])
    regapped = SparsePrompt(first.token_ids, regapped_kept, 400)
    for other in (shifted, regapped):
        tokens, cached = run(llm, other, 8)
        expected_cached = 0 if other is shifted else BLOCK  # regapped: positions agree on 0..199 (block 0)
        assert cached == expected_cached and tokens == reference(hf_model, other, 8)
    # a uniform shift keeps RoPE's relative distances (the same tokens), though its KV differs; new gaps do not
    assert reference(hf_model, regapped, 8) != reference(hf_model, first, 8), "positions must matter here"


def test_ordinary_and_compressed_share_exactly_the_blocks_before_the_first_dropped_token(llm, hf_model):
    full = random_ids(14, 400)
    plain = SparsePrompt.full(full)
    compressed = SparsePrompt.kept(full, torch.tensor([*range(300), *range(340, 400)]))  # first dropped: 300
    assert run(llm, plain, 4)[1] == 0
    tokens, cached = run(llm, compressed, 8)
    assert cached == 2 * BLOCK  # blocks 0..127 and 128..255; block 256..383 holds positions from 340
    assert tokens == reference(hf_model, compressed, 8)
    other = random_ids(15, 400)
    other[:130] = full[:130]  # an ordinary request that agrees with both on block 0 only
    assert run(llm, SparsePrompt.full(other), 4)[1] == BLOCK
    at_a_boundary = SparsePrompt.kept(random_ids(16, 400), torch.tensor([*range(256), *range(300, 400)]))
    assert run(llm, SparsePrompt.full(random_ids(16, 400)), 4)[1] == 0
    assert run(llm, at_a_boundary, 4)[1] == 2 * BLOCK  # the first dropped token opens block 2


def test_a_users_cache_salt_still_separates_requests(llm):
    full = random_ids(17, 400)
    prompt = SparsePrompt.kept(full, torch.tensor([*range(INSTRUCTIONS), *range(250, 400)]))
    assert run(llm, prompt, 4, salt="tenant-a")[1] == 0
    assert run(llm, prompt, 4, salt="tenant-b")[1] == 0  # another tenant: no block shared, block 0 included
    assert run(llm, prompt, 4, salt="tenant-a")[1] == 2 * BLOCK
    assert run(llm, prompt, 4)[1] == 0  # unsalted: not the tenants' blocks
