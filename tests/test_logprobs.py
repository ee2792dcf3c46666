"""Log-probabilities (issue #30): the main model's raw distribution, per generated token, on every surface.

Values are checked against one independent forward of the same model at the same positions (the sparse
prompt's kept tokens at their original positions, then the generated tokens from ``L`` on); shapes against
OpenAI's (chat ``logprobs.content``, the legacy completions ``logprobs``), whole and streamed.
"""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch

import specprefill_rag.backends.hf as hf_backend
from specprefill_rag import GenerationParams
from specprefill_rag.backends.base import SparsePrompt
from specprefill_rag.backends.hf import HFBackend
from specprefill_rag.backends.vllm import VLLMServerBackend, VLLMServerError
from specprefill_rag.decode.detokenize import TokenPieces
from specprefill_rag.gateway_client import find_gateway
from specprefill_rag.prompt.chat import ChatMessage, chat_layout
from specprefill_rag.results import PrefillReport, StepLogprobs
from specprefill_rag.testing import random_documents
from tests.serve_helpers import MODEL, QUESTION, SYSTEM, chat_messages
from tests.test_vllm_client import StandIn, handler_class, serve

DOCUMENTS = random_documents(3, 60, seed=3)
K = 3


def same(got, want):
    """Equal OpenAI-shaped entries, log-probabilities within float noise (a later request may take the main
    model's KV from its prefix cache instead of computing it again).
    """

    def shape(e):
        return e["token"], e["bytes"], [(t["token"], t["bytes"]) for t in e["top_logprobs"]]

    def values(e):
        return [e["logprob"], *(t["logprob"] for t in e["top_logprobs"])]

    assert [shape(e) for e in got] == [shape(e) for e in want]
    assert [values(e) for e in got] == [pytest.approx(values(e), abs=1e-4) for e in want]
    return True


def reference_logprobs(model, input_ids, kept, generated, prompt_length):
    """``[n, V]`` log-probabilities of the steps that produced ``generated``: one forward of the kept tokens at
    their positions followed by the generated tokens (but the last) at ``L``, ``L+1``, ...
    """
    n = len(generated)
    ids = torch.cat([input_ids[kept], torch.tensor(generated[:-1], dtype=torch.long)])
    positions = torch.cat([kept, prompt_length + torch.arange(n - 1)])
    with torch.no_grad():
        logits = model(ids[None], position_ids=positions[None]).logits[0]
    return torch.log_softmax(logits[kept.numel() - 1 :].float(), dim=-1)


def test_greedy_logprobs_are_the_models_for_a_compressed_prompt(engine, tiny_model):
    result = engine.generate(QUESTION, DOCUMENTS, max_new_tokens=6, logprobs=True, top_logprobs=K)
    assert result.stats.compressed and result.kept_positions is not None
    layout = engine.layout(QUESTION, DOCUMENTS)
    expected = reference_logprobs(tiny_model, layout.input_ids, result.kept_positions, result.token_ids, len(layout))
    assert result.logprobs is not None and len(result.logprobs) == len(result.token_ids) == 6
    for step, (token, entry) in enumerate(zip(result.token_ids, result.logprobs)):
        assert entry.token_id == token and int(expected[step].argmax()) == token
        assert entry.logprob == pytest.approx(float(expected[step].max()), abs=1e-4)
        top = entry.top_logprobs
        assert len(top) == K and top[0].token_id == token  # greedy: the chosen token is the most likely
        assert [t.logprob for t in top] == sorted((t.logprob for t in top), reverse=True)
        best = torch.topk(expected[step], K)
        assert [t.token_id for t in top] == best.indices.tolist()
        assert [t.logprob for t in top] == pytest.approx(best.values.tolist(), abs=1e-4)


def test_chunks_carry_their_own_tokens_logprobs_and_the_result_all(engine):
    chunks = list(engine.stream(QUESTION, DOCUMENTS, max_new_tokens=6, logprobs=True, top_logprobs=1))
    result = chunks[-1].result
    assert result is not None and result.logprobs is not None
    for chunk in chunks:
        assert chunk.logprobs is not None and [e.token_id for e in chunk.logprobs] == chunk.token_ids
    assert [e for chunk in chunks for e in chunk.logprobs or ()] == list(result.logprobs)


def test_sampling_and_penalties_do_not_change_the_raw_distribution(engine, tiny_model):
    """A sampled token's logprob is the model's own, before temperature and penalties (vLLM's raw_logprobs)."""
    fields = {"temperature": 1.5, "top_p": 0.9, "seed": 7, "presence_penalty": 1.0, "frequency_penalty": 0.5}
    result = engine.generate(QUESTION, DOCUMENTS, max_new_tokens=5, logprobs=True, top_logprobs=K, **fields)
    layout = engine.layout(QUESTION, DOCUMENTS)
    expected = reference_logprobs(tiny_model, layout.input_ids, result.kept_positions, result.token_ids, len(layout))
    assert result.logprobs is not None
    for step, entry in enumerate(result.logprobs):
        assert entry.logprob == pytest.approx(float(expected[step, entry.token_id]), abs=1e-4)
        assert [t.token_id for t in entry.top_logprobs] == torch.topk(expected[step], K).indices.tolist()


def test_without_logprobs_nothing_is_computed_or_returned(engine, monkeypatch):
    def refuse(logits):
        raise AssertionError("log-probabilities computed for a request that did not ask")

    monkeypatch.setattr(hf_backend, "log_probabilities", refuse)
    chunks = list(engine.stream(QUESTION, DOCUMENTS, max_new_tokens=4))
    assert all(chunk.logprobs is None for chunk in chunks)
    assert chunks[-1].result is not None and chunks[-1].result.logprobs is None
    report = PrefillReport()
    prompt = SparsePrompt.full(engine.layout(QUESTION, DOCUMENTS).input_ids)
    list(engine.backend.generate(prompt, GenerationParams(max_new_tokens=3), report))
    assert report.logprobs == []


def test_the_backend_reports_each_token_before_yielding_it(tiny_model, tokenizer):
    report = PrefillReport()
    prompt = SparsePrompt.full(torch.tensor(tokenizer("the bridge opened in")["input_ids"]))
    params = GenerationParams(max_new_tokens=4, logprobs=True)
    for index, token in enumerate(HFBackend(tiny_model, frozenset()).generate(prompt, params, report)):
        assert len(report.logprobs) == index + 1 and report.logprobs[index].token_id == token
        assert report.logprobs[index].top_ids == ()  # top_logprobs=0: the chosen token only


def test_token_pieces_give_the_exact_bytes_of_partial_characters(tokenizer):
    pieces = TokenPieces(tokenizer)
    ids = tokenizer.encode(" café €", add_special_tokens=False)
    assert pieces.byte_level
    assert b"".join(bytes(pieces(token)[1]) for token in ids) == " café €".encode()
    assert pieces(tokenizer.convert_tokens_to_ids("<|im_end|>")) == ("<|im_end|>", tuple(b"<|im_end|>"))


def test_server_candidates_keep_the_top_k_and_the_chosen_token():
    candidates = {5: -0.1, 9: -2.0, 7: -0.5, 3: -4.0}  # vLLM: the top 2 and the sampled token 3
    step = StepLogprobs.from_candidates(3, candidates, 2)
    assert step == StepLogprobs(3, -4.0, (5, 7), (-0.1, -0.5))
    with pytest.raises(KeyError):
        StepLogprobs.from_candidates(11, candidates, 2)
    masked = StepLogprobs.from_candidates(3, {3: 0.0, 4: float("-inf")}, 2)  # a token a grammar forbids
    assert masked.top_logprobs == (0.0, -9999.0)  # as OpenAI and vLLM write -inf: JSON has no infinity


# -- the gateway ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def client(gateway):
    return openai.OpenAI(base_url=gateway + "/v1", api_key="unused", max_retries=0, timeout=60)


def chat(client, **fields):
    extra = {"spec_prefill": {"documents": DOCUMENTS}}
    return client.chat.completions.create(
        model=MODEL, messages=chat_messages(), max_tokens=5, temperature=0, extra_body=extra, **fields
    )


def test_chat_logprobs_are_openais_shape_and_the_engines_values(client, engine):
    answer = chat(client, logprobs=True, top_logprobs=2)
    content = answer.choices[0].logprobs.content
    assert len(content) == answer.usage.completion_tokens == 5
    for entry in content:
        assert set(entry.model_dump()) == {"token", "logprob", "bytes", "top_logprobs"}
        assert len(entry.top_logprobs) == 2 and entry.top_logprobs[0].token == entry.token
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    messages = [ChatMessage("system", [SYSTEM]), ChatMessage("user", [QUESTION])]
    layout = chat_layout(engine.tokenizer, messages, DOCUMENTS).layout
    params = GenerationParams(max_new_tokens=5, logprobs=True, top_logprobs=2)
    reference = engine.generate_layout(layout, params).logprobs
    assert reference is not None
    assert same([e.model_dump() for e in content], [e.as_openai() for e in reference])
    assert chat(client).choices[0].logprobs is None


def test_streamed_chat_logprobs_add_up_to_the_whole_answers(client):
    whole = chat(client, logprobs=True, top_logprobs=3).choices[0].logprobs.content
    streamed = chat(client, logprobs=True, top_logprobs=3, stream=True)
    pieces = [entry for chunk in streamed if chunk.choices for entry in chunk.choices[0].logprobs.content]
    assert same([e.model_dump() for e in pieces], [e.model_dump() for e in whole])


def test_legacy_completion_logprobs(gateway, engine):
    body = {"model": MODEL, "prompt": QUESTION, "max_tokens": 4, "temperature": 0, "logprobs": 2}
    whole = httpx.post(gateway + "/v1/completions", json=body, timeout=60).json()["choices"][0]["logprobs"]
    assert set(whole) == {"tokens", "token_logprobs", "top_logprobs", "text_offset"}
    assert len(whole["tokens"]) == len(whole["token_logprobs"]) == len(whole["top_logprobs"]) == 4
    for token, logprob, top in zip(whole["tokens"], whole["token_logprobs"], whole["top_logprobs"]):
        assert top[token] == logprob and 2 <= len(top) <= 3  # the top 2, and the sampled token
    assert whole["text_offset"] == [sum(len(t) for t in whole["tokens"][:i]) for i in range(4)]
    reference = engine.generate_text(QUESTION, max_new_tokens=4, logprobs=True)
    assert whole["token_logprobs"] == pytest.approx([e.logprob for e in reference.logprobs], abs=1e-4)
    events = []
    with httpx.stream("POST", gateway + "/v1/completions", json={**body, "stream": True}, timeout=60) as response:
        for line in response.iter_lines():
            if line.startswith("data: {"):
                events.append(json.loads(line[6:])["choices"][0]["logprobs"])
    assert [t for e in events for t in e["tokens"]] == whole["tokens"]
    assert [o for e in events for o in e["text_offset"]] == whole["text_offset"]


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs", "less than or equal to 20"),
        ({"logprobs": True, "top_logprobs": -1}, "top_logprobs", "greater than or equal to 0"),
        ({"logprobs": True, "top_logprobs": True}, "top_logprobs", "valid integer"),
        ({"logprobs": True, "top_logprobs": "3"}, "top_logprobs", "valid integer"),
        ({"top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
        ({"logprobs": False, "top_logprobs": 3}, "top_logprobs", "needs logprobs: true"),
        ({"logprobs": "yes"}, "logprobs", "valid boolean"),
    ],
)
def test_bad_chat_logprobs_get_a_400_naming_the_field(gateway, fields, param, says):
    body = {"model": MODEL, "messages": chat_messages(), "max_tokens": 2, **fields}
    response = httpx.post(gateway + "/v1/chat/completions", json=body, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == param and says in error["message"]


@pytest.mark.parametrize(("value", "says"), [(6, "less than or equal to 5"), (True, "valid integer"), ("2", "integer")])
def test_bad_legacy_logprobs_get_a_400(gateway, value, says):
    body = {"model": MODEL, "prompt": QUESTION, "max_tokens": 2, "logprobs": value}
    response = httpx.post(gateway + "/v1/completions", json=body, timeout=60)
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "logprobs" and says in error["message"]


def test_the_gateway_client_reads_logprobs_back(gateway, engine):
    client = find_gateway(gateway, 60, None)
    assert client is not None
    params = GenerationParams(max_new_tokens=5, logprobs=True, top_logprobs=2)
    body = client.body(chat_messages(), {"documents": DOCUMENTS}, params)
    assert body["logprobs"] is True and body["top_logprobs"] == 2
    replies = list(client.stream(body))
    result = replies[-1].chunk.result
    assert result is not None and result.logprobs is not None and len(result.logprobs) == 5
    assert [e for r in replies for e in r.chunk.logprobs or ()] == list(result.logprobs)
    assert all(e.token_id is None and len(e.top_logprobs) == 2 for e in result.logprobs)
    whole = client.complete(body).chunk.result
    assert whole is not None and whole.logprobs is not None
    assert same([e.as_openai() for e in whole.logprobs], [e.as_openai() for e in result.logprobs])
    plain = client.complete(client.body(chat_messages(), {}, GenerationParams(max_new_tokens=2))).chunk.result
    assert plain is not None and plain.logprobs is None


# -- a vLLM server's completions stream (a stand-in, no vLLM needed) --------------------------------


class LogprobStandIn(StandIn):
    """Streams tokens 5, 6, 7 then end-of-sequence 2 with vLLM's legacy logprobs (``token_id:<id>`` keys):
    the sampled token first, then the top ``logprobs`` (the sampled one once when it is among them).
    """

    plugin = True
    omit_logprobs = False

    def _stream_tokens(self):
        body = self.bodies[-1]
        for token in (5, 6, 7, 2):
            top = {f"token_id:{token}": -0.5, "token_id:40": -0.25, "token_id:41": -1.0, "token_id:42": -3.0}
            top = dict(list(top.items())[: body.get("logprobs", 0) + 1])
            logprobs = {"tokens": [f"token_id:{token}"], "token_logprobs": [-0.5], "top_logprobs": [top]}
            choice = {"index": 0, "text": "", "token_ids": [token]}
            if "logprobs" in body and not self.omit_logprobs:
                choice["logprobs"] = {**logprobs, "text_offset": [0]}
            self.wfile.write(f"data: {json.dumps({'choices': [choice]})}\n\n".encode())
        self.wfile.write(b"data: [DONE]\n\n")


@pytest.fixture
def logprob_server():
    handler = handler_class(LogprobStandIn)
    server, url = serve(handler)
    yield VLLMServerBackend(url, frozenset({2})), handler
    server.shutdown()


def test_server_backend_asks_for_logprobs_and_reads_them_back(logprob_server):
    backend, handler = logprob_server
    prompt = SparsePrompt.full(torch.tensor([1, 2, 3]))
    report = PrefillReport()
    tokens = list(backend.generate(prompt, GenerationParams(max_new_tokens=8, logprobs=True, top_logprobs=2), report))
    assert handler.bodies[-1]["logprobs"] == 2 and handler.bodies[-1]["return_tokens_as_token_ids"] is True
    assert tokens == [5, 6, 7]  # end-of-sequence is not yielded, nor are its log-probabilities reported
    assert report.logprobs == [StepLogprobs(t, -0.5, (40, t), (-0.25, -0.5)) for t in tokens]
    plain = PrefillReport()
    assert list(backend.generate(prompt, GenerationParams(max_new_tokens=8), plain)) == tokens
    assert "logprobs" not in handler.bodies[-1] and plain.logprobs == []


def test_async_server_backend_reports_the_same_logprobs(logprob_server):
    backend, _ = logprob_server
    prompt = SparsePrompt.full(torch.tensor([1, 2, 3]))
    params = GenerationParams(max_new_tokens=8, logprobs=True, top_logprobs=1)
    blocking, streamed = PrefillReport(), PrefillReport()
    list(backend.generate(prompt, params, blocking))

    async def stream():
        return [token async for token in backend.agenerate(prompt, params, streamed)]

    tokens = asyncio.run(stream())
    assert tokens == [5, 6, 7] and streamed.logprobs == blocking.logprobs
    assert [step.top_ids for step in streamed.logprobs] == [(40,)] * 3


def test_a_stream_without_the_asked_logprobs_is_an_error(logprob_server):
    backend, handler = logprob_server
    handler.omit_logprobs = True
    params = GenerationParams(max_new_tokens=8, logprobs=True)
    with pytest.raises(VLLMServerError, match="1 tokens but 0 log-probabilities"):
        list(backend.generate(SparsePrompt.full(torch.tensor([1, 2, 3])), params, PrefillReport()))
