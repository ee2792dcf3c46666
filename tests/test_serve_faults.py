"""Faults: each gives its documented status, and the next request succeeds.

The main model is a stand-in vLLM server on 127.0.0.1 (tests/test_vllm_client.py) that can be told to
break a stream off, to hang, or to stream slowly; draft faults use the tiny in-process engine with
its draft replaced by one that fails or blocks. Every wait is bounded."""

import threading
import time
from contextlib import contextmanager

import httpx
import openai
import pytest

from specprefill_rag import SpecPrefillEngine
from specprefill_rag.errors import DraftScoringError
from specprefill_rag.testing import random_documents
from tests.serve_helpers import MODEL, chat_messages, gateway_of, running_gateway, tiny_engine, wait_for
from tests.test_vllm_client import StandIn, handler_class, serve

DOCUMENTS = random_documents(3, 60)
BODY = {
    "model": MODEL,
    "messages": chat_messages(),
    "max_tokens": 8,
    "temperature": 0,
    "spec_prefill": {"documents": DOCUMENTS},
}


class Upstream(StandIn):
    """``mode``: ``ok``; ``cut`` (two tokens, then the connection closes with no [DONE], as when vLLM is
    killed); ``hang`` (headers, then nothing until ``release``); ``slow`` (``delay`` s per token)."""

    mode = "ok"
    release: threading.Event

    def _stream_tokens(self):
        if self.mode == "hang":
            self.release.wait(20)
            return
        if self.mode == "cut":
            for token in self.tokens[:2]:
                self.wfile.write(
                    f'data: {{"choices": [{{"index": 0, "text": "", "token_ids": [{token}]}}]}}\n\n'.encode()
                )
            return
        super()._stream_tokens()


@pytest.fixture
def upstream():
    handler = handler_class(Upstream, plugin=True, release=threading.Event())
    server, url = serve(handler)
    yield url, handler
    handler.release.set()
    server.shutdown()


@contextmanager
def gateway_before(upstream_url, tiny_model_dir, upstream_timeout_s, request_timeout_s):
    """A gateway whose main model is the stand-in at ``upstream_url``."""
    engine = SpecPrefillEngine.for_vllm(
        upstream_url,
        draft=str(tiny_model_dir),
        keep_rate=0.3,
        min_prompt_tokens=0,
        look_ahead=2,
        timeout=upstream_timeout_s,
    )
    with running_gateway(
        engine,
        main=upstream_url,
        draft="smollm2-135m",
        upstream_timeout_s=upstream_timeout_s,
        request_timeout_s=request_timeout_s,
    ) as gateway_url:
        yield gateway_url


@pytest.fixture
def remote_gateway(upstream, tiny_model_dir):
    """Short upstream reads (1 s), for the faults a read timeout detects: the stand-in's ``hang`` and ``cut``
    modes do not depend on the machine's speed."""
    url, handler = upstream
    with gateway_before(url, tiny_model_dir, upstream_timeout_s=1.0, request_timeout_s=5.0) as gateway_url:
        yield gateway_url, handler


def post(url, body=BODY, timeout=30):
    return httpx.post(url + "/v1/chat/completions", json=body, timeout=timeout)


def test_upstream_killed_mid_stream_gives_502_and_the_next_request_succeeds(remote_gateway):
    url, upstream = remote_gateway
    upstream.mode = "cut"
    refused = post(url)
    assert (
        refused.status_code == 502
        and "closed the stream after 2 tokens, before it ended" in refused.json()["error"]["message"]
    )
    with httpx.stream("POST", url + "/v1/chat/completions", json={**BODY, "stream": True}, timeout=30) as streamed:
        events = [line for line in streamed.iter_lines() if line.startswith("data:")]
    assert streamed.status_code == 200 and '"BadGatewayError"' in events[-2] and events[-1] == "data: [DONE]"
    upstream.mode = "ok"
    assert post(url).status_code == 200


def test_upstream_hanging_gives_504(remote_gateway):
    url, upstream = remote_gateway
    upstream.mode = "hang"
    started = time.monotonic()
    refused = post(url)
    assert refused.status_code == 504 and "timed out" in refused.json()["error"]["message"]
    assert time.monotonic() - started < 60  # the stand-in holds it up to 20 s: the 1 s read timeout must act first
    upstream.release.set()
    upstream.mode = "ok"
    assert post(url).status_code == 200


def test_request_deadline_gives_504(upstream, tiny_model_dir):
    """Tokens every 0.5 s for 20 s: each read well within the 30 s read timeout, the whole past the 3 s deadline."""
    upstream_url, handler = upstream
    handler.mode, handler.delay, handler.tokens = "slow", 0.5, tuple(range(5, 45))
    with gateway_before(upstream_url, tiny_model_dir, upstream_timeout_s=30.0, request_timeout_s=3.0) as url:
        refused = post(url, timeout=60)
        assert refused.status_code == 504 and "deadline of 3 s" in refused.json()["error"]["message"]
        handler.delay, handler.tokens = 0.0, (5, 6, 7)
        assert post(url).status_code == 200


def test_client_disconnect_cancels_the_upstream_request(remote_gateway):
    url, upstream = remote_gateway
    upstream.mode, upstream.delay, upstream.tokens = "slow", 0.2, tuple(range(5, 60))
    with httpx.stream(
        "POST", url + "/v1/chat/completions", json={**BODY, "stream": True, "max_tokens": 60}, timeout=30
    ) as streamed:
        next(line for line in streamed.iter_lines() if line.startswith("data:"))
    assert upstream.disconnected.wait(60), "the gateway kept the upstream stream open after the client left"
    upstream.delay, upstream.tokens = 0.0, (5, 6, 7)
    assert post(url).status_code == 200
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert 'specprefill_requests_total{endpoint="chat",outcome="disconnected"} 1.0' in metrics


@pytest.fixture
def engine(tokenizer, tiny_model, tiny_draft):
    return tiny_engine(tokenizer, tiny_model, tiny_draft)


class BlockedDraft:
    """Replaces a gateway's batched scoring: waits for ``release`` (bounded), then scores for real."""

    def __init__(self, queue):
        self.queue, self.real = queue, queue._score_batch
        self.release, self.entered = threading.Event(), threading.Event()
        queue._score_batch = self

    def __call__(self, prompts):
        self.entered.set()
        self.release.wait(120)  # bounded, and far past any test's release however busy the machine
        return self.real(prompts)


def test_full_queue_gives_429_with_retry_after(engine):
    with running_gateway(engine, queue_size=1, draft_batch_size=1) as url:
        gateway = gateway_of(url)
        blocked = BlockedDraft(gateway.queue)
        with httpx.Client(timeout=30) as client:
            in_draft = _in_background(lambda: client.post(url + "/v1/chat/completions", json=BODY))
            assert blocked.entered.wait(60)
            waiting = _in_background(lambda: client.post(url + "/v1/chat/completions", json=BODY))
            wait_for(lambda: gateway.queue.depth == 1)
            time.sleep(2.0)  # no batch has finished yet: the estimate is the running batch's age, at least this
            refused = client.post(url + "/v1/chat/completions", json=BODY)
            # one request waiting, so two batches of at least 2 s each before a place frees
            assert refused.status_code == 429 and int(refused.headers["Retry-After"]) >= 4
            assert "queue is full" in refused.json()["error"]["message"]
            blocked.release.set()
            assert in_draft.result().status_code == 200 and waiting.result().status_code == 200
            assert client.post(url + "/v1/chat/completions", json=BODY).status_code == 200


def test_client_leaving_the_queue_frees_its_slot(engine):
    with running_gateway(engine, queue_size=1, draft_batch_size=1) as url:
        gateway = gateway_of(url)
        blocked = BlockedDraft(gateway.queue)
        in_draft = _in_background(lambda: post(url))
        assert blocked.entered.wait(60)
        with pytest.raises(httpx.ReadTimeout):
            post(url, timeout=1.0)  # waits in the queue, then the client gives up and disconnects
        wait_for(lambda: gateway.queue.depth == 0)
        blocked.release.set()
        assert in_draft.result().status_code == 200
        assert post(url).status_code == 200


@pytest.mark.parametrize("policy", ["full", "fail"])
def test_draft_error_follows_the_policy(engine, policy):
    with running_gateway(engine, on_draft_error=policy) as url:
        gateway = gateway_of(url)
        real = gateway.queue._score_batch
        gateway.queue._score_batch = lambda prompts: [DraftScoringError("non-finite scores") for _ in prompts]
        answered = post(url)
        metrics = httpx.get(url + "/metrics", timeout=10).text
        assert f'specprefill_draft_errors_total{{error="DraftScoringError",policy="{policy}"}} 1.0' in metrics
        if policy == "full":
            stats = answered.json()["spec_prefill"]
            assert answered.status_code == 200 and not stats["compressed"] and "non-finite" in stats["draft_error"]
            assert stats["keep_policy"] == "fixed"  # the request's policy, not the --on-draft-error value
            auto = post(url, {**BODY, "spec_prefill": {**BODY["spec_prefill"], "keep_rate": "auto"}})
            assert auto.json()["spec_prefill"]["keep_policy"] == "auto"
        else:
            assert answered.status_code == 500 and "non-finite" in answered.json()["error"]["message"]
        gateway.queue._score_batch = real
        assert post(url).json()["spec_prefill"]["compressed"]


def test_a_batch_that_fails_whole_is_retried_one_prompt_at_a_time(engine):
    with running_gateway(engine, draft_batch_size=4) as url:
        gateway = gateway_of(url)
        real = gateway.queue._score_batch

        def out_of_memory_for_batches(prompts):
            if len(prompts) > 1:
                raise RuntimeError("CUDA out of memory (simulated)")
            return real(prompts)

        blocked = BlockedDraft(gateway.queue)
        gateway.queue._score_batch = out_of_memory_for_batches
        first = _in_background(lambda: post(url))
        blocked_batch = [_in_background(lambda: post(url)) for _ in range(3)]
        blocked.release.set()
        answers = [first.result()] + [b.result() for b in blocked_batch]
        assert all(a.status_code == 200 and a.json()["spec_prefill"]["draft_error"] is None for a in answers)


class _Background:
    def __init__(self, work):
        self._result, self._error = None, None
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=True)
        self._thread.start()

    def _run(self, work):
        try:
            self._result = work()
        except BaseException as error:  # handed to the test thread
            self._error = error

    def result(self, timeout=30.0):
        self._thread.join(timeout)
        assert not self._thread.is_alive(), "background request did not finish in time"
        if self._error is not None:
            raise self._error
        return self._result


def _in_background(work):
    return _Background(work)


def test_openai_client_sees_429_as_rate_limit(engine):
    with running_gateway(engine, queue_size=1, draft_batch_size=1) as url:
        gateway = gateway_of(url)
        blocked = BlockedDraft(gateway.queue)
        first = _in_background(lambda: post(url))
        assert blocked.entered.wait(60)
        second = _in_background(lambda: post(url))
        wait_for(lambda: gateway.queue.depth == 1)
        client = openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=30)
        with pytest.raises(openai.RateLimitError):
            client.chat.completions.create(
                model=MODEL,
                messages=chat_messages(),
                max_tokens=2,
                extra_body={"spec_prefill": {"documents": DOCUMENTS}},
            )
        blocked.release.set()
        assert first.result().status_code == 200 and second.result().status_code == 200
