"""Forced tool calls (tool_choice ``required`` or a tool's name) with a vLLM main: the structural tag of
specprefill_rag.decode.formats, enforced by vLLM's own xgrammar backend, in process, over HTTP, through the engine
and through the gateway.

The model is a tiny random Llama over a Qwen-style vocabulary in which ``<tool_call>`` and ``</tool_call>`` are
single added tokens, so the calls must be written with those tokens. The tools' parameters are finite (enums,
bounded integers), so even a random model's constrained answer ends.
"""

import json

import openai
import pytest
import torch

from specprefill_rag import SpecPrefillEngine
from specprefill_rag.backends.base import SparsePrompt
from specprefill_rag.backends.vllm import VLLMOfflineBackend, VLLMServerBackend
from specprefill_rag.config import GenerationParams
from specprefill_rag.decode.tool_calls import parse_tool_calls
from specprefill_rag.decode.tool_choice import tool_decoding
from specprefill_rag.prompt.chat import ChatMessage
from specprefill_rag.serve import GatewaySettings, create_app
from specprefill_rag.serve.server import BackgroundServer
from specprefill_rag.testing import build_family_tokenizer, random_documents
from tests.vllm.conftest import save_tiny_llama
from tests.vllm.server import openai_server


def tool(name, properties):
    parameters = {"type": "object", "properties": properties, "required": list(properties)}
    return {"type": "function", "function": {"name": name, "description": f"the {name} tool", "parameters": parameters}}


WEATHER = tool(
    "get_weather", {"city": {"enum": ["Paris", "Oslo"]}, "days": {"type": "integer", "minimum": 1, "maximum": 7}}
)
CLOCK = tool("get_time", {"zone": {"enum": ["UTC", "CET"]}})
TOOLS = (WEATHER, CLOCK)
SETTINGS = {"keep_rate": 0.3, "min_prompt_tokens": 0, "look_ahead": 2, "dtype": "float32"}
MESSAGES = [ChatMessage("user", ["What is the weather in Paris, and the time?"])]
DOCUMENTS = random_documents(2, 25, seed=5)


def valid(name, arguments):
    if name == "get_weather":
        return (
            set(arguments) == {"city", "days"}
            and arguments["city"] in ("Paris", "Oslo")
            and 1 <= arguments["days"] <= 7
        )
    return name == "get_time" and arguments in ({"zone": "UTC"}, {"zone": "CET"})


@pytest.fixture(scope="module")
def tokenizer():
    return build_family_tokenizer("qwen3")


@pytest.fixture(scope="module")
def qwen_folder(tmp_path_factory, tokenizer):
    return save_tiny_llama(tmp_path_factory.mktemp("tiny-qwen-vocab"), tokenizer)


@pytest.fixture(scope="module")
def qwen_llm(qwen_folder):
    from vllm import LLM

    engine = LLM(
        model=str(qwen_folder),
        max_model_len=1024,
        dtype="float32",
        enforce_eager=True,
        gpu_memory_utilization=0.2,
    )
    yield engine
    del engine


@pytest.fixture(scope="module")
def qwen_server(qwen_folder, qwen_llm):
    with openai_server(qwen_folder) as url:
        yield url


@pytest.fixture(scope="module")
def prompt(tokenizer):
    """A chat with the tools rendered, every third document token dropped (the plugin's positions)."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Weather in Paris? " + DOCUMENTS[0]}],
        tools=list(TOOLS),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    ids = torch.tensor(ids)
    kept = torch.tensor([i for i in range(ids.numel()) if i % 3 or i >= ids.numel() - 8])
    return SparsePrompt.kept(ids, kept)


def forced(backend, tokenizer, prompt, choice, parallel):
    """The backend's answer under ``tool_choice=choice``: its tokens and its parsed calls."""
    fields = tool_decoding(tokenizer, TOOLS, choice, parallel)
    params = GenerationParams(max_new_tokens=300, **fields)
    backend.check_output_format(params.output_format)
    tokens = list(backend.generate(prompt, params))
    parsed = parse_tool_calls(tokenizer.decode(tokens, skip_special_tokens=False), "hermes")
    return tokens, parsed


def check_calls(tokens, parsed, tokenizer, names):
    """One or more calls, each naming one of ``names`` with arguments valid for it, markers as single tokens."""
    open_id, close_id = tokenizer.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    assert parsed.invalid_tool_calls == () and parsed.content == "", parsed
    assert parsed.tool_calls, parsed
    assert all(call.name in names and valid(call.name, call.arguments) for call in parsed.tool_calls), parsed
    assert tokens[0] == open_id and tokens[-1] == close_id
    assert tokens.count(open_id) == tokens.count(close_id) == len(parsed.tool_calls)


@pytest.fixture(scope="module", params=["offline", "server"])
def backend(request, tokenizer):
    """The offline backend as built directly (markers from vLLM's own tokenizer), the server one as the engine
    builds it (markers from the adopted tokenizer)."""
    eos = frozenset({tokenizer.eos_token_id})
    if request.param == "offline":
        return VLLMOfflineBackend(request.getfixturevalue("qwen_llm"), eos)
    server = VLLMServerBackend(request.getfixturevalue("qwen_server"), frozenset())
    server.adopt_tokenizer(tokenizer, eos)
    return server


@pytest.mark.parametrize("choice, names", [("required", {"get_weather", "get_time"}), ("get_time", {"get_time"})])
def test_a_forced_call_names_the_tool_with_valid_arguments(backend, tokenizer, prompt, choice, names):
    tokens, parsed = forced(backend, tokenizer, prompt, choice, parallel=False)
    check_calls(tokens, parsed, tokenizer, names)
    assert len(parsed.tool_calls) == 1  # parallel_tool_calls false: exactly one


def test_required_with_parallel_calls_writes_calls_separated_by_newlines(backend, tokenizer, prompt):
    tokens, parsed = forced(backend, tokenizer, prompt, "required", parallel=True)
    check_calls(tokens, parsed, tokenizer, {"get_weather", "get_time"})


def test_the_request_carries_the_structural_tag_with_the_marker_ids(qwen_server, tokenizer, prompt):
    backend = VLLMServerBackend(qwen_server, frozenset())
    fields = tool_decoding(tokenizer, TOOLS, "get_time", False)
    with pytest.raises(Exception, match="needs the served model's tokenizer"):
        backend.check_output_format(fields["output_format"])  # not adopted yet: the markers are unknown
    backend.adopt_tokenizer(tokenizer, frozenset({tokenizer.eos_token_id}))
    body = backend._body(prompt, GenerationParams(max_new_tokens=8, **fields))
    tag = json.loads(body["structured_outputs"]["structural_tag"])
    elements = tag["format"]["elements"]
    assert elements[0] == {"type": "token", "token": tokenizer.convert_tokens_to_ids("<tool_call>")}
    assert elements[-1] == {"type": "token", "token": tokenizer.convert_tokens_to_ids("</tool_call>")}


@pytest.mark.parametrize("main", ["qwen_llm", "qwen_server"])
def test_engine_chat_over_a_vllm_main_returns_the_forced_call(request, main, qwen_folder):
    engine = SpecPrefillEngine.for_vllm(request.getfixturevalue(main), draft=str(qwen_folder), **SETTINGS)
    result = engine.chat(
        MESSAGES, DOCUMENTS, tools=TOOLS, tool_choice="get_weather", parallel_tool_calls=False, max_new_tokens=200
    )
    assert result.stats.compressed
    [call] = result.tool_calls
    assert call.name == "get_weather" and valid(call.name, call.arguments)
    assert result.invalid_tool_calls == ()


def test_the_gateway_in_front_of_vllm_forces_the_named_tool(qwen_server, qwen_folder):
    settings = GatewaySettings(main=qwen_server, draft=str(qwen_folder), device="cpu", **SETTINGS)
    with BackgroundServer(create_app(settings)) as url:
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)
        response = client.chat.completions.create(
            model=client.models.list().data[0].id,
            messages=[{"role": "user", "content": "What time is it in Berlin?"}],
            tools=list(TOOLS),
            tool_choice={"type": "function", "function": {"name": "get_time"}},
            max_tokens=200,
            temperature=0,
            extra_body={"spec_prefill": {"documents": DOCUMENTS}},
        )
    choice = response.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.function.name == "get_time" and valid("get_time", json.loads(call.function.arguments))


def test_auto_sends_the_lazy_tag_and_vllm_decodes_under_it(backend, tokenizer, prompt, caplog):
    """tool_choice="auto" (#45): the lazy structural tag (triggered tags: the marker and each tool's bare JSON
    openings) is accepted by vLLM's xgrammar backend, offline and over HTTP, and the answer decodes under it; any
    call in it names an offered tool. (A random model rarely writes a trigger: the tag's effect after one is
    tested in-process with xgrammar, tests/test_lazy_tools.py.)"""
    fields = tool_decoding(tokenizer, TOOLS, "auto", True, lazy=True)
    output = fields["output_format"]
    assert output.lazy
    backend.check_output_format(output)
    with caplog.at_level("WARNING", logger="specprefill_rag"):
        tokens = list(backend.generate(prompt, GenerationParams(max_new_tokens=24, **fields)))
    assert tokens and not [r for r in caplog.records if "without its lazy tool-call grammar" in r.getMessage()]
    parsed = parse_tool_calls(
        tokenizer.decode(tokens, skip_special_tokens=False), "hermes", offered=("get_weather", "get_time")
    )
    assert all(valid(call.name, call.arguments) for call in parsed.tool_calls)
