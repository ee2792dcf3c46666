"""Faults against vLLM's real OpenAI server on CPU (the stand-in versions are tests/test_faults.py).

The client talks to the real server through a proxy the test drives (tests/vllm/fault_proxy.py), so each fault
lands where the test says whatever the machine's speed: frozen before answering and mid-stream (the client's
read timeout fires), dropped mid-stream. Then the server itself, in its own process group, is killed (SIGKILL)
mid-stream, a request to the dead server is refused, and restarted on the same port, the same engines serve
again. No client thread or socket outlives a failed request, and the next request succeeds.
"""

import asyncio
import os
import re
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from specprefill_rag import GenerationParams, SpecPrefillEngine
from specprefill_rag.backends.vllm import VLLMServerError
from specprefill_rag.testing import random_documents
from tests.leaks import nothing_left_behind
from tests.vllm.fault_proxy import Fault, FaultProxy, server_lead_bytes
from tests.vllm.server import free_port, server_command, wait_until_serving

MODES = ("sync", "async")
# The client's timeout for every request that is not meant to time out: a hang guard, never why a slow machine
# fails. 60 s was crossed once (CI, stop 55: the killed stream's first response, on a clone whose file took 182 s
# against 112-125 s in other runs), so it is generous; a request that does hang still fails, only later.
PATIENT = 300.0
# The client's timeout where a freeze is detected by it (each frozen case waits it out once). The proxy decides
# when the freeze happens; before it, a read only waits for the server's next step (the response headers, the
# prefill of the compressed prompt, a decode step), and so does each read of the request that follows on the same
# engine. Measured here with both cores kept busy: first event within 0.45 s, no later gap over 0.4 s (40 requests).
IMPATIENT = 15.0
EVENTS = 2  # the stream's events the proxy forwards before a fault
SHORT = GenerationParams(max_new_tokens=32)  # more events than EVENTS: the endless model never stops early
# The killed stream: the proxy kills the server once it has read and forwarded EVENTS events. A stream of 1,000
# tokens took the server 2-4 s here, and once its whole stream sat in the socket buffers before the proxy got to the
# kill (CI, stop 35). So the stream is longer in bytes than all the server can have written beyond what the proxy has
# read (fault_proxy.server_lead_bytes: about 4.4 MB with Linux's default 4 MiB send-buffer limit): however fast the
# server decodes, it is still writing when it dies. Each event is at least EVENT_BYTES (274 measured: the event's
# JSON with the model's path, one token's text and id).
EVENT_BYTES = 200
KILLED = GenerationParams(max_new_tokens=24_000)
FIRST = GenerationParams(max_new_tokens=4)
CONTEXT = 26 * 1024  # the prompt and KILLED


@pytest.fixture(scope="module")
def endless_folder(tiny_folder, tmp_path_factory):
    """The tiny model with the logits of its end-of-sequence token and of every token that is not printable
    ASCII text pinned at 0 (their output rows zeroed): greedy decoding never ends a stream early, and the engine
    streams each token as an event of its own at once (partial UTF-8 would hold text back)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_folder)
    model = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32)
    silent = [
        i
        for i in range(model.lm_head.weight.shape[0])
        if i >= len(tokenizer)
        or not (text := tokenizer.decode([i])).strip()
        or not text.isascii()
        or not text.isprintable()
    ]
    with torch.no_grad():
        model.lm_head.weight[silent] = 0.0
        model.lm_head.weight[tokenizer.eos_token_id] = 0.0
    model.config.max_position_embeddings = CONTEXT  # rotary positions extend as they are
    folder = tmp_path_factory.mktemp("tiny-endless")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@dataclass
class Server:
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1:``port`` in a session of its own, so that
    killing its process group kills all of it (the engine core too)."""

    folder: Path
    port: int
    process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        # Every request recomputes its prompt: a prefix-cache hit rounds differently, and the tiny model's
        # near-zero logits could then pick another token than the reference.
        # Prefill in chunks: a profile run over the whole context is not needed for the tiny model.
        options = ("--max-model-len", str(CONTEXT), "--max-num-batched-tokens", "2048", "--no-enable-prefix-caching")
        self.process = subprocess.Popen(
            server_command(self.folder, self.port, *options),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        wait_until_serving(self.process, self.url)

    def kill(self) -> None:
        try:
            os.killpg(self.process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.process.wait(timeout=60)


@pytest.fixture(scope="module")
def server(endless_folder):
    served = Server(endless_folder, free_port())
    served.start()
    yield served
    served.kill()


@pytest.fixture(scope="module")
def proxy(server):
    with FaultProxy(server.port).running() as running:
        yield running


def _engine(url, draft, timeout):
    return SpecPrefillEngine.for_vllm(
        url, draft=str(draft), timeout=timeout, keep_rate=0.3, dtype="float32", min_prompt_tokens=0, look_ahead=2
    )


@pytest.fixture(scope="module")
def patient(proxy, tiny_folder):
    return _engine(proxy.url, tiny_folder, PATIENT)


@pytest.fixture(scope="module")
def impatient(proxy, tiny_folder):
    return _engine(proxy.url, tiny_folder, IMPATIENT)


@pytest.fixture(scope="module")
def layout(patient):
    return patient.layout("When did the bridge open?", random_documents(3, 30))


@pytest.fixture(scope="module")
def reference(patient, layout):
    """The first tokens of the answer, from a normal request: what every recovered request must give."""
    return _request(patient, layout, "sync").token_ids


def _request(engine, layout, mode, params=FIRST):
    if mode == "sync":
        return engine.generate_layout(layout, params)
    return asyncio.run(asyncio.wait_for(engine.agenerate_layout(layout, params), timeout=600))  # a hang guard


def _fails(engine, layout, mode, params, pattern):
    """The request's ``VLLMServerError`` message (it must match ``pattern``); nothing of it is left behind."""
    with nothing_left_behind(), pytest.raises(VLLMServerError, match=pattern) as caught:
        _request(engine, layout, mode, params)
    return str(caught.value)


@pytest.mark.parametrize("mode", MODES)
def test_frozen_before_answering(mode, proxy, impatient, layout, reference):
    fault = proxy.arm(Fault())
    unanswered = f"cannot reach a vLLM server at {re.escape(proxy.url)} within {IMPATIENT:g} s"
    _fails(impatient, layout, mode, SHORT, unanswered)
    assert fault.cut.is_set()
    assert _request(impatient, layout, mode).token_ids == reference


@pytest.mark.parametrize("mode", MODES)
def test_frozen_mid_stream(mode, proxy, impatient, layout, reference):
    fault = proxy.arm(Fault(after_events=EVENTS))
    message = _fails(impatient, layout, mode, SHORT, f"reads time out after {IMPATIENT:g} s")
    assert fault.events == EVENTS
    assert f"failed mid-stream after {fault.tokens} tokens" in message
    assert _request(impatient, layout, mode).token_ids == reference


@pytest.mark.parametrize("mode", MODES)
def test_dropped_mid_stream(mode, proxy, patient, layout, reference):
    fault = proxy.arm(Fault(after_events=EVENTS, then="close"))
    message = _fails(patient, layout, mode, SHORT, "(failed mid-stream|closed the stream) after")
    assert fault.events == EVENTS
    assert re.search(f"(failed mid-stream|closed the stream) after {fault.tokens} tokens", message), message
    assert _request(patient, layout, mode).token_ids == reference


def test_killed_mid_stream_refused_then_restarted(server, proxy, patient, tiny_folder, layout, reference):
    lead = server_lead_bytes()
    assert KILLED.max_new_tokens * EVENT_BYTES > lead, f"the killed stream must be longer than {lead} bytes"
    direct = _engine(server.url, tiny_folder, PATIENT)  # no proxy: the dead server's port itself refuses
    fault = proxy.arm(Fault(after_events=EVENTS, then="relay", on_cut=server.kill))
    message = _fails(patient, layout, "sync", KILLED, "(failed mid-stream|closed the stream) after")
    assert fault.events == EVENTS and server.process.returncode == -signal.SIGKILL
    received = int(re.search(r"after (\d+) tokens", message)[1])
    assert fault.tokens <= received < KILLED.max_new_tokens, message

    for engine in (patient, direct):  # nothing listens any more
        for mode in MODES:
            _fails(engine, layout, mode, FIRST, f"cannot reach a vLLM server at {re.escape(engine.backend.base_url)}")

    server.start()  # on the same port: the same engines serve again
    for engine in (patient, direct):
        for mode in MODES:
            assert _request(engine, layout, mode).token_ids == reference
