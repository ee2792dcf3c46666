"""Faults against vLLM's real OpenAI server on CPU (the stand-in versions are tests/test_faults.py).

A dedicated server process, in its own process group so the test can stop and kill all of it:
frozen (SIGSTOP) before answering and mid-stream, the client's timeout fires; killed (SIGKILL)
mid-stream, the stream ends in a typed error, and a request to the dead server is refused; restarted on
the same port, the same engine serves again. No client thread or socket outlives a failed request.
"""

import asyncio
import os
import re
import signal
import subprocess
from contextlib import contextmanager

import pytest

from specprefill_rag import GenerationParams, SpecPrefillEngine
from specprefill_rag.backends.vllm import VLLMServerError
from specprefill_rag.testing import random_documents
from tests.leaks import nothing_left_behind
from tests.vllm.server import free_port, server_command, wait_until_idle, wait_until_serving

TIMEOUT = 5.0  # the client's timeout
# A stream that outlasts the faults (checked below): a warm server decodes the tiny model at well over
# 500 tokens a second, and a fault sent after the first chunk must land before the stream ends (the
# prompt's ~200 tokens and these fit in CONTEXT).
LONG = GenerationParams(max_new_tokens=7000)
CONTEXT = 8192


@pytest.fixture(scope="module")
def endless_folder(tiny_folder, tmp_path_factory):
    """The tiny model with the logits of its end-of-sequence token and of every token that is not printable
    ASCII text pinned at 0 (their output rows zeroed): greedy decoding never ends a stream early, and each
    token is text the engine streams at once (a run of partial UTF-8 bytes would hold every chunk back
    until the end, and the fault sent after the first chunk would then land after the stream)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tiny_folder)
    model = AutoModelForCausalLM.from_pretrained(tiny_folder, dtype=torch.float32)
    silent = [i for i in range(model.lm_head.weight.shape[0])
              if i >= len(tokenizer) or not (text := tokenizer.decode([i])).strip() or not text.isascii()
              or not text.isprintable()]
    with torch.no_grad():
        model.lm_head.weight[silent] = 0.0
        model.lm_head.weight[tokenizer.eos_token_id] = 0.0
    model.config.max_position_embeddings = CONTEXT  # room for LONG (rotary positions extend as they are)
    folder = tmp_path_factory.mktemp("tiny-endless")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


@contextmanager
def vllm_server(folder, port):
    """``python -m vllm.entrypoints.openai.api_server`` on 127.0.0.1:``port`` in a new session; killed with
    its whole process group on exit."""
    # Every request of this test recomputes its prompt: a prefix-cache hit rounds differently, and the tiny
    # model's near-zero logits could then pick the end-of-sequence token mid-test.
    command = server_command(folder, port, "--max-model-len", str(CONTEXT), "--no-enable-prefix-caching")
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until_serving(process, f"http://127.0.0.1:{port}")
        yield process
    finally:
        _signal_group(process, signal.SIGCONT)
        _signal_group(process, signal.SIGKILL)
        process.wait(timeout=60)


def _signal_group(process, sig):
    try:
        os.killpg(process.pid, sig)
    except ProcessLookupError:
        pass


def _stream_until_first_chunk_then(engine, layout, mode, act):
    """Stream ``layout``; after the first chunk, ``act()``; return the number of chunks received."""
    received = []
    if mode == "sync":
        for chunk in engine.stream_layout(layout, LONG):
            received.append(chunk)
            if len(received) == 1:
                act()
        return len(received)

    async def consume():
        async for chunk in engine.astream_layout(layout, LONG):
            received.append(chunk)
            if len(received) == 1:
                act()

    asyncio.run(asyncio.wait_for(consume(), timeout=120))
    return len(received)


def _freeze_mid_stream(engine, layout, mode, process, tries=3):
    """Freeze the server after the first chunk: the stream must end in the client's timeout error.

    A server that sent the whole stream before the freeze landed (the client read its first chunk late, on a
    loaded machine) leaves nothing to test; that try is repeated, and at least one of ``tries`` must fail
    mid-stream with the typed error."""
    for _ in range(tries):
        try:
            with nothing_left_behind():
                try:
                    chunks = _stream_until_first_chunk_then(engine, layout, mode,
                                                            lambda: _signal_group(process, signal.SIGSTOP))
                except VLLMServerError as error:
                    assert re.search(r"failed mid-stream after \d+ tokens", str(error)), str(error)
                    return
        finally:
            _signal_group(process, signal.SIGCONT)
        assert chunks > 1, "a stream that outran the freeze still came whole"
    pytest.fail(f"the server had sent the whole stream before each of {tries} freezes landed")


def _request(engine, layout, mode, params=GenerationParams(max_new_tokens=4)):
    if mode == "sync":
        return engine.generate_layout(layout, params)
    return asyncio.run(asyncio.wait_for(engine.agenerate_layout(layout, params), timeout=120))


def test_frozen_killed_and_restarted_server(tiny_folder, endless_folder):
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with vllm_server(endless_folder, port) as process:
        engine = SpecPrefillEngine.for_vllm(url, draft=str(tiny_folder), timeout=TIMEOUT, keep_rate=0.3,
                                            dtype="float32", min_prompt_tokens=0, look_ahead=2)
        layout = engine.layout("When did the bridge open?", random_documents(3, 30))
        whole = _request(engine, layout, "sync", LONG)
        assert whole.finish_reason == "length", "the stream must outlast the faults below"

        for mode in ("sync", "async"):  # frozen before answering: no bytes at all
            _signal_group(process, signal.SIGSTOP)
            try:
                with nothing_left_behind(), pytest.raises(VLLMServerError, match=f"within {TIMEOUT:g} s"):
                    _request(engine, layout, mode)
            finally:
                _signal_group(process, signal.SIGCONT)
            assert len(_request(engine, layout, mode).token_ids) == 4

        for mode in ("sync", "async"):  # frozen mid-stream
            _freeze_mid_stream(engine, layout, mode, process)
            # right after a freeze the server still runs the abandoned 7,000-token stream (busy at the first poll
            # when this was measured), and a request sent then once got no token within the 5 s timeout
            wait_until_idle(url)
            assert len(_request(engine, layout, mode).token_ids) == 4

        with nothing_left_behind(), pytest.raises(VLLMServerError, match="(failed mid-stream|closed the stream) after"):
            _stream_until_first_chunk_then(engine, layout, "sync", lambda: _signal_group(process, signal.SIGKILL))
        process.wait(timeout=60)
        for mode in ("sync", "async"):  # nothing listens any more
            with nothing_left_behind(), pytest.raises(VLLMServerError, match=f"cannot reach a vLLM server at {url}"):
                _request(engine, layout, mode)

    with vllm_server(endless_folder, port):  # restarted on the same port: the same engine serves again
        for mode in ("sync", "async"):
            assert _request(engine, layout, mode).token_ids == whole.token_ids[:4]
