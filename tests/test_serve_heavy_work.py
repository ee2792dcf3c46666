"""Heavy work at the gateway (issue #43): output grammars within their limits, compiled on their own bounded
workers under the request's deadline, warm-ups on theirs; ordinary requests are served meanwhile.

Nothing here depends on the machine's speed: blocked work is held by events the tests release, and the checks
count threads, compiles and answers; the waits allow many times what they need.
"""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from specprefill_rag import SpecPrefillEngine
from specprefill_rag.config import WARM_DOCUMENTS_PATH
from specprefill_rag.results import WarmReport
from specprefill_rag.testing import build_tokenizer, random_documents
from tests.serve_helpers import MODEL, chat_messages, gateway_of, running_gateway

SLACK_S = 120.0
TEMPLATE = Path(__file__).parent / "fixtures" / "chat_templates" / "qwen2_5.jinja"
ENUM_LIMIT = 16  # low, so that a tool over it still fits the tiny model's context
GOOD = {"model": MODEL, "messages": chat_messages(), "max_tokens": 4, "temperature": 0}


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}


def tool(name: str, parameters: dict) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters}}


@pytest.fixture(scope="module")
def engine(tiny_model, tiny_draft):
    tokenizer = build_tokenizer()  # its own, with a template that offers tools
    tokenizer.chat_template = TEMPLATE.read_text()
    return SpecPrefillEngine.from_models(
        tiny_model, tokenizer, tiny_draft, keep_rate=0.3, min_prompt_tokens=0, max_enum_values=ENUM_LIMIT
    )


@pytest.fixture(scope="module")
def gateway(engine):
    with running_gateway(engine) as url:
        yield url


def post(url, body, path="/v1/chat/completions"):
    return httpx.post(url + path, json=body, timeout=SLACK_S)


def compiles(engine) -> int:
    compiler = engine.backend._compiler
    return 0 if compiler is None else compiler.compiles


# -- limits before compiling --------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("schema", "says"),
    [
        ({"type": "string", "pattern": "^[a-z]{40000}$"}, "max_pattern_repeat"),
        ({"type": "string", "pattern": "^(([a-z]{1,10}){1,10})$"}, "max_pattern_nested_repeat"),
        (
            {"anyOf": [{"type": "object", "properties": {f"k{i}": {"type": "string"}}} for i in range(3000)]},
            "max_schema_branches",
        ),
    ],
)
def test_a_schema_over_a_limit_is_a_400_naming_response_format_and_is_not_compiled(gateway, engine, schema, says):
    before = compiles(engine)
    response = post(gateway, {**GOOD, "response_format": schema_format(schema)})
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format" and says in error["message"]
    assert compiles(engine) == before


def test_a_forced_calls_tool_over_a_limit_is_named_by_its_index(gateway, engine):
    tools = [
        tool("search", {"type": "object"}),
        tool("pick", {"type": "object", "properties": {"x": {"enum": list(range(ENUM_LIMIT + 1))}}}),
    ]
    body = {**GOOD, "tools": tools, "tool_choice": {"type": "function", "function": {"name": "pick"}}}
    before = compiles(engine)
    response = post(gateway, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "tools[1].function.parameters" and "max_enum_values" in error["message"]
    assert compiles(engine) == before


def test_a_schema_within_the_limits_is_compiled_once_and_served(gateway, engine):
    fmt = schema_format({"type": "object", "properties": {"year": {"type": "integer"}}, "required": ["year"]})
    before = compiles(engine)
    for _ in range(2):
        assert post(gateway, {**GOOD, "max_tokens": 12, "response_format": fmt}).status_code == 200
    assert compiles(engine) == before + 1  # the second came from the cache


def test_a_grammar_dead_end_is_a_400_naming_response_format_not_a_500(gateway):
    body = {**GOOD, "max_tokens": 8, "response_format": schema_format({"type": "string", "pattern": r"[^\s\S]"})}
    response = post(gateway, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "response_format" and "cannot be completed" in error["message"]
    assert post(gateway, GOOD).status_code == 200


def test_a_grammar_dead_end_while_streaming_is_an_error_event_with_a_400(gateway):
    schema = schema_format({"type": "string", "pattern": r"[^\s\S]"})
    body = {**GOOD, "max_tokens": 8, "stream": True, "response_format": schema}
    with httpx.stream("POST", gateway + "/v1/chat/completions", json=body, timeout=SLACK_S) as response:
        events = [line[len("data: ") :] for line in response.iter_lines() if line.startswith("data: ")]
    errors = [json.loads(event)["error"] for event in events if event.startswith('{"error"')]
    assert events[-1] == "[DONE]" and len(errors) == 1
    assert errors[0]["code"] == 400 and errors[0]["param"] == "response_format"


# -- compiles: their own bounded workers, the request's deadline --------------------------------------


class Blocked:
    """Replaces the backend's check (the compile) with one that waits for :meth:`release`; counts who ran it."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.running = 0
        self.most = 0
        self.threads: set[str] = set()
        self._lock = threading.Lock()

    def __call__(self, *_: object, **__: object) -> int:
        if self.gate.is_set():  # after the release: the engine's own check of the (cached) format
            return 0
        with self._lock:
            self.running += 1
            self.most = max(self.most, self.running)
            self.threads.add(threading.current_thread().name)
        try:
            self.gate.wait(SLACK_S)
        finally:
            with self._lock:
                self.running -= 1
        return 0

    def release(self) -> None:
        self.gate.set()


def test_a_compile_past_the_deadline_is_a_504_and_never_a_200(engine, monkeypatch):
    blocked = Blocked()
    monkeypatch.setattr(engine.backend, "check_output_format", blocked)
    body = {**GOOD, "response_format": schema_format({"type": "object"})}
    with running_gateway(engine, request_timeout_s=1.0) as url:
        try:
            response = post(url, body)
        finally:
            blocked.release()
        assert response.status_code == 504, response.text
        assert "compiling the output format" in response.json()["error"]["message"]
    assert blocked.threads and all(name.startswith("specprefill-grammar") for name in blocked.threads)


def test_compiles_take_only_their_workers_and_normal_requests_are_served_meanwhile(engine, monkeypatch):
    blocked = Blocked()
    monkeypatch.setattr(engine.backend, "check_output_format", blocked)
    body = {**GOOD, "response_format": schema_format({"type": "object"})}
    workers, queue, sent = 2, 2, 8
    with running_gateway(engine, grammar_workers=workers, grammar_queue=queue) as url, ThreadPoolExecutor(sent) as pool:
        try:
            heavy = [pool.submit(post, url, body) for _ in range(sent)]
            assert _wait_for(lambda: sum(f.done() for f in heavy) >= sent - workers - queue)
            refused = [f.result() for f in heavy if f.done()]  # at once: past the workers and their queue
            assert len(refused) == sent - workers - queue
            assert all(r.status_code == 503 and r.headers["Retry-After"] for r in refused)
            assert all(r.json()["error"]["type"] == "ServiceUnavailableError" for r in refused)
            for _ in range(3):  # the compiles hold their own threads only
                assert post(url, GOOD).status_code == 200
            assert blocked.running == workers  # the rest wait in the queue
        finally:
            blocked.release()
        statuses = sorted(f.result().status_code for f in heavy)
        assert statuses == [200] * (workers + queue) + [503] * (sent - workers - queue)
        assert blocked.most == workers and len(blocked.threads) <= workers
        assert all(name.startswith("specprefill-grammar") for name in blocked.threads)


# -- warm-ups: their own bounded workers --------------------------------------------------------------


def test_warm_ups_take_only_their_workers_and_normal_requests_are_served_meanwhile(engine, monkeypatch):
    blocked = Blocked()
    monkeypatch.setattr(engine, "warm_report", lambda *args, **kwargs: WarmReport(blocked(*args, **kwargs)))
    documents = {"documents": random_documents(1, 20, seed=431)}
    sent, queue = 6, 2
    with running_gateway(engine, warm_workers=1, warm_queue=queue) as url, ThreadPoolExecutor(sent) as pool:
        try:
            warming = [pool.submit(post, url, documents, WARM_DOCUMENTS_PATH) for _ in range(sent)]
            assert _wait_for(lambda: sum(f.done() for f in warming) >= sent - 1 - queue)
            refused = [f.result() for f in warming if f.done()]
            assert [r.status_code for r in refused] == [503] * (sent - 1 - queue)
            assert all(r.json()["error"]["param"] is None and "--warm-workers" in r.text for r in refused)
            for _ in range(3):
                assert post(url, GOOD).status_code == 200
            assert blocked.running == 1
        finally:
            blocked.release()
        statuses = sorted(f.result().status_code for f in warming)
        assert statuses == [200] * (1 + queue) + [503] * (sent - 1 - queue)
        assert blocked.most == 1 and len(blocked.threads) == 1
        assert all(name.startswith("specprefill-warm") for name in blocked.threads)


def _wait_for(condition, timeout_s: float = SLACK_S) -> bool:
    done = threading.Event()
    for _ in range(int(timeout_s * 20)):
        if condition():
            return True
        done.wait(0.05)
    return False


def test_the_gateway_keeps_its_workers_apart(gateway):
    workers = gateway_of(gateway)
    assert workers.grammar_workers is not workers.warm_workers
    assert workers.grammar_workers.threads == 2 and workers.warm_workers.threads == 1
