"""The gateway against hostile and careless clients (loopback only, every loop and wait bounded).

Each case is answered with a 4xx that names the problem, within its timeout, and the next normal
request is served: big and endless bodies, slow headers, browser-style requests, JSON built to hurt
the parser, values that would break sampling, a burst of maximal requests (memory stays bounded).
Nothing here depends on the machine's speed: the deadlines under test are seconds, and the checks
allow many times that before failing.
"""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from contextlib import closing
from urllib.parse import urlsplit

import httpx
import pytest
from pydantic import ValidationError

from specprefill_rag.cli import main
from specprefill_rag.serve import GatewaySettings
from specprefill_rag.testing import random_documents
from tests.serve_helpers import MODEL, chat_messages, gateway_of, running_gateway, tiny_engine, wait_for

BODY_LIMIT = 64 * 1024
LIMITS = {"max_body_bytes": BODY_LIMIT, "header_timeout_s": 1.0, "body_timeout_s": 1.0}
SLACK_S = 30.0  # a deadline of 1 s must act well within this, however busy the machine
GOOD = {"model": MODEL, "messages": chat_messages(), "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def engine(tokenizer, tiny_model, tiny_draft):
    return tiny_engine(tokenizer, tiny_model, tiny_draft)


@pytest.fixture(scope="module")
def gateway(engine):
    with running_gateway(engine, **LIMITS) as url:
        yield url


def post(url, body, path="/v1/chat/completions", **options):
    return httpx.post(url + path, json=body, timeout=SLACK_S, **options)


def raw(url, body: bytes, headers: dict[str, str] | None = None, path="/v1/chat/completions") -> bytes:
    """Send exactly ``body`` with ``headers`` (a JSON content type unless given) and return the raw answer."""
    headers = {"Content-Type": "application/json", "Content-Length": str(len(body)), **(headers or {})}
    with closing(_connect(url)) as sock:
        try:
            sock.sendall(_head(url, path, headers) + body)
        except OSError:  # the server answered (413) and closed before taking the whole body: read its answer
            pass
        return _read_all(sock)


def _connect(url) -> socket.socket:
    parts = urlsplit(url)
    return socket.create_connection((parts.hostname, parts.port), timeout=SLACK_S)


def _head(url, path, headers) -> bytes:
    lines = [
        f"POST {path} HTTP/1.1",
        f"Host: {urlsplit(url).netloc}",
        "Connection: close",
        *(f"{k}: {v}" for k, v in headers.items()),
    ]
    return ("\r\n".join(lines) + "\r\n\r\n").encode()


def _read_all(sock) -> bytes:
    """Everything the server sends until it closes. A server that closes with part of a refused body unread
    resets the connection (TCP RST) after its answer; what arrived before that is the answer."""
    chunks = []
    try:
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    except ConnectionResetError:
        pass
    return b"".join(chunks)


def status_of(answer: bytes) -> int:
    return int(answer.split(b" ", 2)[1])


def error_of(answer: bytes) -> dict:
    return json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]


def served_normally(url) -> bool:
    response = post(url, GOOD)
    return response.status_code == 200 and response.json()["choices"][0]["message"]["content"] is not None


def metric(url, outcome, endpoint="chat") -> float:
    for line in httpx.get(url + "/metrics", timeout=SLACK_S).text.splitlines():
        if line.startswith(f'specprefill_requests_total{{endpoint="{endpoint}",outcome="{outcome}"}}'):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no requests_total series for {outcome}")


# -- bodies ------------------------------------------------------------------------------------------


def test_a_body_over_the_limit_gets_413_before_it_is_read(gateway):
    body = json.dumps({**GOOD, "messages": [{"role": "user", "content": "x" * (2 * BODY_LIMIT)}]}).encode()
    answer = raw(gateway, body)
    assert status_of(answer) == 413 and f"limit of {BODY_LIMIT} bytes" in error_of(answer)["message"]
    assert served_normally(gateway)


def test_a_chunked_body_over_the_limit_gets_413_as_it_arrives(gateway):
    def chunks():
        for _ in range(16):  # 16 x 8 KiB: twice the limit (and little enough for the sockets' buffers)
            yield b" " * 8192

    response = httpx.post(
        gateway + "/v1/chat/completions",
        content=chunks(),
        timeout=SLACK_S,
        headers={"Content-Type": "application/json"},
    )
    assert response.status_code == 413 and response.json()["error"]["type"] == "RequestTooLargeError"
    assert served_normally(gateway)


def test_a_body_that_never_completes_gets_408(gateway):
    before = metric(gateway, "client_timeout")
    with closing(_connect(gateway)) as sock:
        sock.sendall(
            _head(gateway, "/v1/chat/completions", {"Content-Type": "application/json", "Content-Length": "1000"})
            + b'{"model": '
        )
        started = time.monotonic()
        answer = _read_all(sock)
    assert status_of(answer) == 408 and "did not arrive within 1 s" in error_of(answer)["message"]
    assert time.monotonic() - started < SLACK_S
    assert metric(gateway, "client_timeout") == before + 1
    assert served_normally(gateway)


def test_a_client_gone_mid_body_counts_as_disconnected_not_error(gateway):
    before = metric(gateway, "disconnected"), metric(gateway, "error")
    with closing(_connect(gateway)) as sock:
        sock.sendall(
            _head(gateway, "/v1/chat/completions", {"Content-Type": "application/json", "Content-Length": "1000"})
            + b'{"model": '
        )
    deadline = time.monotonic() + SLACK_S
    while metric(gateway, "disconnected") == before[0]:
        assert time.monotonic() < deadline, "the disconnect was never counted"
        time.sleep(0.05)
    assert metric(gateway, "error") == before[1]


def test_slow_headers_are_cut_off(gateway):
    """Slowloris: 20 connections that trickle header bytes are all closed after the header deadline."""
    sockets = [_connect(gateway) for _ in range(20)]
    try:
        for sock in sockets:
            sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        deadline = time.monotonic() + SLACK_S
        open_ = set(range(len(sockets)))
        while open_ and time.monotonic() < deadline:
            for index in list(open_):
                try:
                    sockets[index].sendall(b"X-Slow: 1\r\n")
                    sockets[index].settimeout(0.05)
                    if sockets[index].recv(1) == b"":
                        open_.discard(index)
                except TimeoutError:
                    pass
                except OSError:  # reset by the server
                    open_.discard(index)
            time.sleep(0.2)
        assert not open_, f"{len(open_)} trickling connections were still open after {SLACK_S:g} s"
    finally:
        for sock in sockets:
            sock.close()
    assert served_normally(gateway)


def test_an_idle_connection_is_closed_and_a_keep_alive_one_serves_again(gateway):
    with closing(_connect(gateway)) as idle:
        idle.settimeout(SLACK_S)
        assert idle.recv(1) == b""  # nothing sent: closed at the header deadline
    with httpx.Client(timeout=SLACK_S) as client:  # one connection, two requests within the deadline
        assert client.post(gateway + "/v1/chat/completions", json=GOOD).status_code == 200
        assert client.post(gateway + "/v1/chat/completions", json=GOOD).status_code == 200


# -- browsers ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "content_type", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", None]
)
def test_a_post_that_is_not_json_gets_415(gateway, content_type):
    headers = {"Content-Type": content_type} if content_type else {}
    body = json.dumps(GOOD).encode()
    response = httpx.post(gateway + "/v1/chat/completions", content=body, headers=headers, timeout=SLACK_S)
    assert response.status_code == 415 and "application/json" in response.json()["error"]["message"]


def test_json_with_a_charset_is_json(gateway):
    response = httpx.post(
        gateway + "/v1/chat/completions",
        content=json.dumps(GOOD).encode(),
        timeout=SLACK_S,
        headers={"Content-Type": "Application/JSON; charset=utf-8"},
    )
    assert response.status_code == 200


@pytest.mark.parametrize("host", ["evil.example", "127.0.0.1.evil.example", "localhost.evil.example"])
def test_a_foreign_host_header_is_refused(gateway, host):
    """DNS rebinding: a page on another name resolving to 127.0.0.1 sends its own Host."""
    assert post(gateway, GOOD, headers={"Host": host}).status_code == 400
    assert httpx.get(gateway + "/v1/models", headers={"Host": host}, timeout=SLACK_S).status_code == 400


@pytest.mark.parametrize("host", ["localhost", "127.0.0.1", "[::1]"])
def test_loopback_names_are_answered(gateway, host):
    port = urlsplit(gateway).port
    assert post(gateway, GOOD, headers={"Host": f"{host}:{port}"}).status_code == 200


def test_no_cors_unless_configured(gateway, engine):
    origin = {"Origin": "https://page.example"}
    answer = post(gateway, GOOD, headers=origin)
    assert answer.status_code == 200 and "access-control-allow-origin" not in answer.headers
    preflight = httpx.options(
        gateway + "/v1/chat/completions", timeout=SLACK_S, headers={**origin, "Access-Control-Request-Method": "POST"}
    )
    assert "access-control-allow-origin" not in preflight.headers
    with running_gateway(engine, cors_origins=("https://app.example",), api_key="k") as url:
        allowed = httpx.options(
            url + "/v1/chat/completions",
            timeout=SLACK_S,
            headers={
                "Origin": "https://app.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "authorization, content-type",
            },
        )
        assert allowed.status_code == 200 and allowed.headers["access-control-allow-origin"] == "https://app.example"
        other = httpx.options(
            url + "/v1/chat/completions", timeout=SLACK_S, headers={**origin, "Access-Control-Request-Method": "POST"}
        )
        assert "access-control-allow-origin" not in other.headers


# -- the key ---------------------------------------------------------------------------------------


def test_with_a_key_every_route_but_health_needs_it(engine):
    with running_gateway(engine, api_key="s3cret") as url:
        for path in ("/docs", "/redoc", "/openapi.json", "/v1/models"):
            assert httpx.get(url + path, timeout=SLACK_S).status_code == 401, path
            assert httpx.get(url + path, headers={"Authorization": "Bearer s3cret"}, timeout=SLACK_S).status_code == 200
        assert post(url, GOOD).status_code == 401
        assert post(url, GOOD, headers={"Authorization": "Bearer wrong"}).status_code == 401
        assert post(url, GOOD, headers={"Authorization": "Basic s3cret"}).status_code == 401
        for scheme in ("Bearer", "bearer", "BEARER"):
            assert post(url, GOOD, headers={"Authorization": f"{scheme} s3cret"}).status_code == 200, scheme
        assert httpx.get(url + "/health", timeout=SLACK_S).status_code == 200
        assert httpx.get(url + "/metrics", timeout=SLACK_S).status_code == 401  # its counts are of every tenant
        keyed = httpx.get(url + "/metrics", headers={"Authorization": "Bearer s3cret"}, timeout=SLACK_S)
        assert keyed.status_code == 200


@pytest.mark.parametrize("key", ["", " ", "key ", " key", "key\n"])
def test_a_key_nobody_could_send_is_refused_at_start(key, capsys):
    with pytest.raises(ValidationError, match="api_key"):
        GatewaySettings(api_key=key)
    assert main(["serve", "--api-key", key, "--port", "1"]) == 2
    assert "api_key" in capsys.readouterr().err


# -- JSON and values ---------------------------------------------------------------------------------

HOSTILE_JSON = [
    ("nested 30,000 deep", b'{"model": ' + b"[" * 30_000 + b"]" * 30_000 + b"}", "recursion limit"),
    ("an integer of 5,000 digits", b'{"model": "tiny", "seed": ' + b"9" * 5000 + b"}", "number out of range"),
    ("a lone surrogate in model", b'{"model": "\\ud800", "messages": []}', "hex escape"),
    ("NaN", b'{"model": "tiny", "temperature": NaN}', "not valid JSON"),
    ("Infinity", b'{"model": "tiny", "temperature": Infinity}', "not valid JSON"),
    ("not UTF-8", b'{"model": "\xff\xfe"}', "not valid JSON"),
    ("a JSON array", b"[1, 2]", "must be a JSON object"),
    ("empty", b"", "not valid JSON"),
]


@pytest.mark.parametrize("case, body, says", HOSTILE_JSON, ids=[case[0] for case in HOSTILE_JSON])
def test_hostile_json_gets_a_400(gateway, case, body, says):
    answer = raw(gateway, body)
    assert status_of(answer) == 400 and says in error_of(answer)["message"], answer[:300]


HUGE = 10**4000
BAD_VALUES = [
    ({"temperature": True}, "temperature", "valid number"),
    ({"stream": "yes"}, "stream", "valid boolean"),
    ({"stream": 1}, "stream", "valid boolean"),
    ({"max_tokens": 4.0}, "max_tokens", "valid integer"),
    ({"max_tokens": "4"}, "max_tokens", "valid integer"),
    ({"seed": 1.5}, "seed", "valid integer"),
    ({"top_p": "1"}, "top_p", "valid number"),
    ({"model": 5}, "model", "valid string"),
    ({"max_tokens": HUGE}, "max_tokens", "less than or equal to"),
    ({"seed": HUGE}, "seed", "less than"),
    ({"n": HUGE}, "n", "characters)"),
    ({"temperature": 1e-45}, "temperature", "use 0 for greedy"),
    ({"temperature": 0.001}, "temperature", "at least 0.01"),
    ({"stop": ["x"] * 33}, "stop", "at most 32"),
    ({"spec_prefill": {"max_document_tokens": 1e30}}, "spec_prefill.max_document_tokens", "valid integer"),
    ({"spec_prefill": {"max_document_tokens": 10**30}}, "spec_prefill.max_document_tokens", "less than or equal"),
    ({"spec_prefill": {"keep_rate": "0.3"}}, "spec_prefill.keep_rate", "JSON number"),
    ({"spec_prefill": {"enabled": "false"}}, "spec_prefill.enabled", "valid boolean"),
    ({"spec_prefill": {"documents": ["   "]}}, "spec_prefill.documents", "document 0 is empty"),
    ({"spec_prefill": {"question": " "}}, "spec_prefill.question", "send the user's question, or null"),
    ({"spec_prefill": {"documents": [{"text": "a", "title": " "}]}}, "spec_prefill.documents.0.title", "or null"),
]


@pytest.mark.parametrize("extra, field, says", BAD_VALUES, ids=[str(case[0])[:60] for case in BAD_VALUES])
def test_bad_values_get_a_400_naming_the_field_before_any_work(gateway, extra, field, says):
    response = post(gateway, {**GOOD, **extra})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == field and says in error["message"], error
    assert len(response.content) < 2000, "the error echoed a client's value whole"


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_token_limit_past_the_context_is_a_400_naming_the_field_sent(gateway, field):
    response = post(gateway, {**GOOD, field: 1020})  # the prompt's tokens + 1,020 > the context of 1,024
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == field, error
    assert f"lower {field} to at most" in error["message"] and "max_new_tokens" not in error["message"]


def test_megabyte_tool_lists_are_refused_before_any_tool_is_parsed(engine):
    """Six clients each send ~1 MiB of tool definitions (9,000 tools) at once, beside a normal request: each list
    is a 400 naming tools, counted before any tool is parsed, and the normal request is served."""
    tools = [{"type": "function", "function": {"name": f"t{i}", "description": "d" * 40}} for i in range(9000)]
    body = {**GOOD, "tools": tools}
    with running_gateway(engine) as url:
        assert len(json.dumps(body)) <= gateway_of(url).settings.resolved_max_body_bytes(1024)
        answers: list[httpx.Response] = []
        senders = [threading.Thread(target=lambda: answers.append(post(url, body))) for _ in range(6)]
        for sender in senders:
            sender.start()
        assert served_normally(url)
        for sender in senders:
            sender.join(SLACK_S * 4)
        assert [a.status_code for a in answers] == [400] * 6
        errors = [answer.json()["error"] for answer in answers]
        assert all(e["param"] == "tools" and "9000 tools" in e["message"] for e in errors), errors


def test_a_tiny_top_p_is_greedy(gateway):
    greedy = post(gateway, GOOD).json()["choices"][0]["message"]["content"]
    tiny = post(gateway, {**GOOD, "temperature": 1.0, "top_p": 1e-300, "seed": 3})
    assert tiny.status_code == 200 and tiny.json()["choices"][0]["message"]["content"] == greedy


def test_a_huge_model_name_is_not_echoed(gateway):
    response = post(gateway, {**GOOD, "model": "m" * 50_000})
    assert response.status_code == 404 and len(response.content) < 1000
    assert "(50000 characters)" in response.json()["error"]["message"]


def test_a_prompt_far_over_the_context_is_refused_before_it_is_tokenized(gateway, engine):
    words = " ".join(["bridge river stone"] * 3000)  # 57 KB: under the body limit, far over 1,024 tokens
    for body in (
        {**GOOD, "messages": [{"role": "user", "content": words}]},
        {**GOOD, "spec_prefill": {"documents": [words]}},
    ):
        response = post(gateway, body)
        assert response.status_code == 400 and "has at least" in response.json()["error"]["message"]
        assert response.json()["error"]["param"] == "messages"
    completion = post(gateway, {"model": MODEL, "prompt": words, "max_tokens": 2}, path="/v1/completions")
    assert completion.status_code == 400 and "has at least" in completion.json()["error"]["message"]
    assert completion.json()["error"]["param"] == "prompt"
    tokenized = post(gateway, {"model": MODEL, "prompt": words}, path="/tokenize")
    assert tokenized.status_code == 400 and "context" in tokenized.json()["error"]["message"]


def test_tokenize_runs_off_the_event_loop(gateway, monkeypatch):
    import specprefill_rag.serve.app as app_module

    threads, real = [], app_module.tokenize_request
    monkeypatch.setattr(
        app_module, "tokenize_request", lambda *a: threads.append(threading.current_thread()) or real(*a)
    )
    # the route looked the function up at import; the module attribute is what it calls
    response = post(gateway, {"model": MODEL, "prompt": "When did the bridge open?"}, path="/tokenize")
    assert response.status_code == 200 and response.json()["count"] > 0
    assert threads and all(t.name.startswith("asyncio_") for t in threads), [t.name for t in threads]  # the executor
    assert post(gateway, {"model": MODEL, "prompt": "x", "extra": 1}, path="/tokenize").status_code == 400
    assert post(gateway, {"model": "other", "prompt": "x"}, path="/tokenize").status_code == 404


# -- concurrency and memory ---------------------------------------------------------------------------


def test_the_concurrency_bound_answers_429_with_a_retry_after(engine, monkeypatch):
    """Two requests hold both slots (their work blocked until released); a third request of any kind gets 429."""
    import specprefill_rag.serve.app as app_module

    release, real = threading.Event(), app_module.tokenize_request
    monkeypatch.setattr(app_module, "tokenize_request", lambda *a: release.wait(SLACK_S) and real(*a))
    with running_gateway(engine, max_concurrent_requests=2) as url:
        tokenize = {"model": MODEL, "prompt": "x"}
        holders = [threading.Thread(target=post, args=(url, tokenize), kwargs={"path": "/tokenize"}) for _ in "ab"]
        try:
            for holder in holders:
                holder.start()
            wait_for(lambda: _in_flight(url) >= 2, SLACK_S)
            for attempt in (
                lambda: post(url, GOOD),
                lambda: httpx.get(url + "/v1/models", timeout=SLACK_S),
                lambda: post(url, {"prompt": "x"}, path="/tokenize"),
            ):
                refused = attempt()
                assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
            assert metric(url, "overloaded") == 1
            assert httpx.get(url + "/health", timeout=SLACK_S).status_code == 200  # not counted against the bound
        finally:
            release.set()
            for holder in holders:
                holder.join(SLACK_S)
        wait_for(lambda: _in_flight(url) == 0, SLACK_S)  # the answer reaches the client before the slot is handed back
        assert served_normally(url)


def test_one_api_key_cannot_hold_every_slot(engine, monkeypatch, tmp_path):
    """max_requests_per_key=1: key A's second request in flight gets 429 naming the setting, while key B, and
    key A once its request is done, are served; the slots count per key and free with the request."""
    import specprefill_rag.serve.app as app_module

    release, real = threading.Event(), app_module.tokenize_request
    monkeypatch.setattr(app_module, "tokenize_request", lambda *a: release.wait(SLACK_S) and real(*a))
    key_file = tmp_path / "keys"
    key_file.write_text("key-b-0123456789abcdef\n")
    a, b = ({"Authorization": f"Bearer {key}"} for key in ("key-a-0123456789abcdef", "key-b-0123456789abcdef"))
    settings = {"api_key": "key-a-0123456789abcdef", "api_key_file": key_file, "max_requests_per_key": 1}
    with running_gateway(engine, max_concurrent_requests=4, **settings) as url:
        holder = threading.Thread(
            target=post, args=(url, {"model": MODEL, "prompt": "x"}), kwargs={"path": "/tokenize", "headers": a}
        )
        holder.start()
        try:
            wait_for(lambda: gateway_of(url).slots.of(0) >= 1, SLACK_S)
            refused = post(url, GOOD, headers=a)
            assert refused.status_code == 429 and int(refused.headers["retry-after"]) >= 1
            assert "max_requests_per_key" in refused.json()["error"]["message"]
            assert post(url, GOOD, headers=b).status_code == 200
        finally:
            release.set()
            holder.join(SLACK_S)
        wait_for(lambda: _in_flight(url) == 0 and gateway_of(url).slots.of(0) == 0, SLACK_S)
        assert post(url, GOOD, headers=a).status_code == 200


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"max_requests_per_key": 2}, "no keys"),
        ({"api_key": "k" * 16, "max_requests_per_key": 9, "max_concurrent_requests": 8}, "exceeds"),
    ],
)
def test_a_per_key_bound_that_cannot_act_is_refused(settings, named):
    with pytest.raises(ValidationError, match=named):
        GatewaySettings(main="m", **settings)


def _slow_bodies(url, count: int, source: str) -> list[socket.socket]:
    """``count`` connections from ``source`` that send headers and 10 bytes of a 1,000-byte body, then wait."""
    parts = urlsplit(url)
    head = _head(url, "/v1/chat/completions", {"Content-Type": "application/json", "Content-Length": "1000"})
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((parts.hostname, parts.port), timeout=SLACK_S, source_address=(source, 0))
        sock.sendall(head + b'{"model": ')
        sockets.append(sock)
    return sockets


def _answers(sockets: list[socket.socket], count: int) -> list[int]:
    """The statuses of the first ``count`` of ``sockets`` to be answered (waits at most SLACK_S)."""
    waiting, statuses, deadline = list(sockets), [], time.monotonic() + SLACK_S
    while len(statuses) < count:
        assert time.monotonic() < deadline, f"only {len(statuses)} answered"
        ready, _, _ = select.select(waiting, [], [], 0.5)
        for sock in ready:
            waiting.remove(sock)
            statuses.append(status_of(_read_all(sock)))
    return statuses


def test_slow_bodies_cannot_hold_the_request_slots(engine):
    """130 connections sending unfinished bodies (from another address, as a remote attacker would) against 128
    slots: they hold no slot and only a few body readers, and every normal request is served, not refused."""
    with running_gateway(engine, body_timeout_s=SLACK_S, max_bodies_per_client=4) as url:
        readers = gateway_of(url).readers
        attackers = _slow_bodies(url, 130, "127.0.0.2")
        try:
            wait_for(
                lambda: readers.of("127.0.0.2") >= 4, SLACK_S
            )  # the first four are being read; the rest were answered 429
            assert sorted(_answers(attackers, 126)) == [429] * 126  # the other four are still being read
            assert readers.of("127.0.0.2") == 4 and _in_flight(url) == 0
            answers = [post(url, GOOD).status_code for _ in range(5)]
            assert answers == [200] * 5
        finally:
            for sock in attackers:
                sock.close()


def test_a_complete_body_takes_its_slot_after_the_body_arrived(engine):
    """Bodies in transit hold body readers, not slots: with one slot, a slow body leaves it free for others."""
    with running_gateway(engine, max_concurrent_requests=1, body_timeout_s=SLACK_S) as url:
        [slow] = _slow_bodies(url, 1, "127.0.0.3")
        try:
            wait_for(lambda: gateway_of(url).readers.reading >= 1, SLACK_S)
            assert _in_flight(url) == 0 and served_normally(url)
        finally:
            slow.close()


def _in_flight(url) -> int:
    return gateway_of(url).slots.in_flight


def _rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * 4096


def test_a_burst_of_maximal_requests_keeps_memory_bounded(engine):
    """32 concurrent requests at the default body limit (1 MiB: the tiny model's context is 1,024 tokens) of
    text far over the context: each is refused after counting one piece, and memory grows by far less than
    32 x tokenizing 1 MiB (about 400 MB each with this tokenizer before the bound)."""
    text = " ".join(random_documents(1, 200_000)[0].split())[: (1 << 20) - 200]
    body = json.dumps({**GOOD, "messages": [{"role": "user", "content": text}]}).encode()
    with running_gateway(engine) as url:
        assert len(body) <= gateway_of(url).settings.resolved_max_body_bytes(1024)
        peak, baseline, stop = [0], _rss_bytes(), threading.Event()

        def sample():
            while not stop.is_set():
                peak[0] = max(peak[0], _rss_bytes())
                time.sleep(0.01)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        statuses = []
        workers = [threading.Thread(target=lambda: statuses.append(status_of(raw(url, body)))) for _ in range(32)]
        for worker in workers:
            worker.start()
        for worker in workers:
            worker.join(SLACK_S * 4)
        stop.set()
        sampler.join()
        assert statuses == [400] * 32
        assert peak[0] - baseline < 256 << 20, f"RSS grew by {(peak[0] - baseline) >> 20} MiB"
        assert served_normally(url)


def test_no_5xx_for_any_hostile_request_and_the_next_is_served(gateway):
    """Everything above in one burst, concurrently: all 4xx, all answered, then a normal request."""
    bodies = [body for _, body, _ in HOSTILE_JSON] + [
        json.dumps({**GOOD, **extra}, default=str).encode()
        for extra, _, _ in BAD_VALUES
        if extra.get("max_tokens") != HUGE
    ]
    bodies += [b"x" * (BODY_LIMIT + 1), json.dumps({**GOOD, "model": "?" * 10_000}).encode()]
    statuses = []
    threads = [threading.Thread(target=lambda b=body: statuses.append(status_of(raw(gateway, b)))) for body in bodies]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(SLACK_S * 4)
    assert len(statuses) == len(bodies) and all(400 <= s < 500 for s in statuses), sorted(statuses)
    assert served_normally(gateway)
