"""SpecPrefillModelState against the real vLLM 0.33 Model Runner V2 classes, on CPU tensors.

Each step builds an ``InputBatch`` the way MRV2's ``prepare_inputs`` does (rows -> request slots via
``idx_mapping``, ``query_start_loc``, compact positions = computed tokens + offset, padded tail) in
the runner's own ``InputBuffers``, then checks the positions the model state hands to the model.
"""

import dataclasses
import logging

import numpy as np
import pytest
import torch
from vllm import SamplingParams
from vllm.v1.core.sched.output import NewRequestData
from vllm.v1.worker.gpu.input_batch import InputBatch, InputBuffers
from vllm.v1.worker.gpu.model_states import init_model_state, resolve_model_state_cls

from specprefill_rag.positions import PROMPT_LENGTH_KEY, RUNS_KEY, encode_runs, original_positions
from specprefill_rag.vllm_plugin import models
from specprefill_rag.vllm_plugin.model_state import SpecPrefillModelState

MAX_MODEL_LEN = 64  # the vllm_config fixture's
CPU = torch.device("cpu")


@dataclasses.dataclass(frozen=True)
class Spec:
    kept: list[int]
    prompt_length: int


CHUNKED = Spec([0, 1, 2, *range(10, 15), *range(30, 40)], 40)  # K = 18
DECODING = Spec([*range(0, 4), *range(42, 50)], 50)  # K = 12, shift 38
CACHED = Spec([*range(0, 8), *range(20, 36)], 36)  # K = 24


def request(req_id: str, n_prompt: int, spec: Spec | None = None, computed: int = 0, max_tokens: int = 8):
    """``NewRequestData`` as the scheduler sends it; SpecPrefill arguments in ``extra_args``."""
    extra = {PROMPT_LENGTH_KEY: spec.prompt_length, RUNS_KEY: encode_runs(spec.kept)} if spec else None
    tokens = list(range(n_prompt))
    return NewRequestData(
        req_id=req_id,
        prompt_token_ids=tokens,
        mm_features=[],
        sampling_params=SamplingParams(max_tokens=max_tokens, extra_args=extra),
        pooling_params=None,
        block_ids=([],),
        num_computed_tokens=computed,
        lora_request=None,
        prefill_token_ids=tokens,
    )


def batch(buffers: InputBuffers, rows: list[tuple[str, int, int, int]], padding: int = 0) -> InputBatch:
    """MRV2 batch of ``rows`` = (req_id, slot, num_computed_tokens, num_scheduled_tokens)."""
    scheduled = np.array([n for *_, n in rows], dtype=np.int32)
    num_tokens = int(scheduled.sum())
    dummy = InputBatch.make_dummy(len(rows), num_tokens, buffers)  # a complete batch; fields replaced below
    compact = torch.cat([torch.arange(c, c + n) for _, _, c, n in rows])
    buffers.positions[:num_tokens] = compact
    buffers.positions[num_tokens : num_tokens + padding] = 0  # what MRV2 leaves in padded tokens
    starts = np.concatenate([[0], np.cumsum(scheduled)]).astype(np.int32)
    buffers.query_start_loc[: len(rows) + 1] = torch.from_numpy(starts)
    slots = np.array([s for _, s, _, _ in rows], dtype=np.intp)
    return dataclasses.replace(
        dummy,
        req_ids=[r for r, *_ in rows],
        idx_mapping=torch.from_numpy(slots).long(),
        idx_mapping_np=slots,
        num_scheduled_tokens=scheduled,
        num_tokens=num_tokens,
        num_tokens_after_padding=num_tokens + padding,
        query_start_loc=buffers.query_start_loc[: len(rows) + 1],
        query_start_loc_np=starts,
        num_computed_tokens_np=np.array([c for _, _, c, _ in rows], dtype=np.int32),
        positions=buffers.positions[: num_tokens + padding],
    )


def expected(rows, specs: dict[str, Spec], padding: int = 0) -> torch.Tensor:
    """Reference: ``original_positions`` for SpecPrefill rows, compact positions otherwise, clamped."""
    parts = []
    for req_id, _, computed, n in rows:
        compact = torch.arange(computed, computed + n)
        spec = specs.get(req_id)
        parts.append(original_positions(compact, torch.tensor(spec.kept), spec.prompt_length) if spec else compact)
    return torch.cat([*parts, torch.zeros(padding, dtype=torch.long)]).clamp(max=MAX_MODEL_LEN - 1)


@pytest.fixture()
def state(vllm_config):
    model = models.SpecPrefillLlamaForCausalLM.__new__(models.SpecPrefillLlamaForCausalLM)
    return init_model_state(vllm_config, model, None, CPU)


@pytest.fixture()
def buffers():
    return InputBuffers(max_num_reqs=8, max_num_tokens=64, device=CPU)


@pytest.mark.parametrize("name", ["Llama", "Qwen2", "Qwen3", "Mistral"])
def test_vllm_resolves_our_model_state(vllm_config, name):
    cls = getattr(models, f"SpecPrefill{name}ForCausalLM")
    assert resolve_model_state_cls(vllm_config, cls.__new__(cls)) is SpecPrefillModelState


def test_mixed_batch_over_two_steps(state, buffers):
    specs = {"chunked": CHUNKED, "decoding": DECODING, "cached": CACHED}
    state.add_request(0, request("plain", 20))
    state.add_request(3, request("chunked", 18, CHUNKED))
    state.add_request(1, request("decoding", 12, DECODING, computed=15))  # resumed: prompt + 3 outputs cached
    state.add_request(5, request("cached", 24, CACHED, computed=16))  # prefix-cache hit on the first 16 tokens
    state.apply_staged_writes()

    # step 1: plain prefill, first chunk, one decode token (p=15 -> 53), rest of a cached prompt
    rows = [("plain", 0, 0, 20), ("chunked", 3, 0, 10), ("decoding", 1, 15, 1), ("cached", 5, 16, 8)]
    step1 = batch(buffers, rows, padding=5)
    runner_positions = step1.positions.clone()
    out1 = state.prepare_inputs(step1, None)["positions"]
    assert out1.tolist() == expected(rows, specs, padding=5).tolist()
    assert out1[30] == 15 + DECODING.prompt_length - len(DECODING.kept)
    assert torch.equal(step1.positions, runner_positions), "the runner's own positions must stay compact"
    first = out1.data_ptr()

    # step 2: "cached" finished and its slot went to a new ordinary request; chunk 2 runs into decode
    state.remove_request("cached")
    state.add_request(5, request("reused", 6))
    rows = [("reused", 5, 0, 6), ("chunked", 3, 10, 9), ("plain", 0, 20, 1), ("decoding", 1, 16, 1)]
    out2 = state.prepare_inputs(batch(buffers, rows), None)["positions"]
    assert out2.tolist() == expected(rows, specs).tolist()
    assert out2[6:14].tolist() == CHUNKED.kept[10:] and out2[14] == CHUNKED.prompt_length
    assert out2.data_ptr() == first, "positions must live in one persistent buffer (CUDA graphs)"


def test_ordinary_batch_passes_positions_through(state, buffers):
    state.add_request(2, request("plain", 30))
    rows = [("plain", 2, 7, 23)]
    assert state.prepare_inputs(batch(buffers, rows, padding=3), None)["positions"].tolist() == [*range(7, 30), 0, 0, 0]


def test_removed_requests_leave_no_state(state, buffers):
    state.add_request(4, request("a", 18, CHUNKED))
    state.add_request(6, request("b", 12, DECODING))
    state.prepare_inputs(batch(buffers, [("a", 4, 0, 4), ("b", 6, 0, 4)]), None)
    state.remove_request("a")
    state.remove_request("b")
    state.remove_request("never-added")  # vLLM calls this for every finished request
    assert state.slots == {}
    state.prepare_inputs(batch(buffers, [("c", 4, 3, 2)]), None)
    assert not state.counts.any() and not state.shifts.any() and state.pool.numel() == 1


def test_positions_beyond_max_model_len_are_clamped_with_a_warning(state, buffers, caplog):
    long = Spec([*range(0, 10), *range(50, 60)], 60)  # K = 20; decode p=25 -> 65 > 63
    with caplog.at_level(logging.WARNING, logger="specprefill_rag.vllm_plugin.model_state"):
        state.add_request(0, request("long", 20, long, max_tokens=10))
    assert "exceeds max_model_len 64" in caplog.text
    out = state.prepare_inputs(batch(buffers, [("long", 0, 22, 4)]), None)["positions"]
    assert out.tolist() == [62, 63, 63, 63]


def test_dummy_inputs_use_the_same_buffer(state, buffers):
    state.add_request(0, request("x", 18, CHUNKED))
    real = state.prepare_inputs(batch(buffers, [("x", 0, 0, 18)]), None)["positions"]
    dummy = state.prepare_dummy_inputs(num_reqs=2, num_tokens=32)["positions"]
    assert dummy.data_ptr() == real.data_ptr() and dummy.shape == (32,)
    assert dummy[:18].tolist() == CHUNKED.kept  # a graph captured on it replays what prepare_inputs wrote
