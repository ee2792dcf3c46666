"""Bookkeeping of one streamed request: generated token ids in, :class:`StreamChunk` out.

The engine's blocking and async decode loops differ only in how they get tokens from the backend;
both feed them to a :class:`Decoding`, which owns the text deltas, stop strings, timings, stats and
the final :class:`GenerationResult`.
"""

from __future__ import annotations

import json
import time
from collections.abc import AsyncGenerator, Iterable, Iterator
from contextlib import aclosing
from typing import Any

import torch

from ..config import GenerationParams
from ..errors import SpecPrefillError
from ..prompt.layout import PromptLayout
from ..results import (
    DraftPath,
    FinishReason,
    GenerationResult,
    InvalidToolCall,
    PrefillReport,
    Selection,
    SpecPrefillStats,
    StepLogprobs,
    StreamChunk,
    TokenLogprob,
    ToolCall,
    TopLogprob,
)
from .detokenize import IncrementalText, TokenPieces
from .tool_calls import StreamedPart, ToolCallStream, marker_tokens, new_call_id


class Decoding:
    """Turns the tokens of one request into stream chunks.

    Args:
        tokenizer: the main model's tokenizer (detokenizes the answer).
        layout: the full prompt.
        params: generation parameters (stop strings, ``max_new_tokens``).
        selection: the kept prompt tokens (``[K]`` sorted indices) and what choosing them cost.
        started: ``time.perf_counter()`` when the request arrived (for ``ttft_ms``).
        draft_path: which draft path scored the prompt (None: no draft ran).

    :attr:`report` is handed to the backend, which fills it in (``main_cached_tokens``; with ``params.logprobs``
    each token's log-probabilities, which chunks and the result then carry).
    Create it right before asking the backend for tokens: that instant is the start of the main prefill.
    """

    def __init__(
        self,
        tokenizer: Any,
        layout: PromptLayout,
        params: GenerationParams,
        selection: Selection,
        started: float,
        draft_path: DraftPath | None = None,
    ) -> None:
        self.layout = layout
        self.draft_path = draft_path
        self.params = params
        self.selection = selection
        self.report = PrefillReport()
        self.kept = selection.kept
        self.started = started
        self.text = IncrementalText(tokenizer, params.stop, marker_tokens(tokenizer, params.tool_format))
        self.calls = _CallCollector(params)
        self.logprobs = _LogprobCollector(tokenizer, self.report) if params.logprobs else None
        self.tokens: list[int] = []
        self._pending: list[int] = []
        self._prefill_started = time.perf_counter()
        self._first_token_at: float | None = None

    @property
    def stopped(self) -> bool:
        """A stop string appeared: the caller stops asking for tokens."""
        return self.text.stopped

    def push(self, token: int) -> StreamChunk | None:
        """Add one generated token; the chunk to emit now, if any (text became certain, or a stop)."""
        self._first_token_at = self._first_token_at or time.perf_counter()
        self.tokens.append(token)
        self._pending.append(token)
        if self.logprobs is not None:
            self.logprobs.push(len(self.tokens) - 1, token)
        delta, calls = self.calls.push(self.text.push(token))
        if not (delta or calls or self.text.stopped):
            return None
        chunk = StreamChunk(delta, self._pending, tool_calls=calls, logprobs=self._pending_logprobs())
        self._pending = []
        return chunk

    def chunks(self, tokens: Iterable[int]) -> Iterator[StreamChunk]:
        """The chunks of a blocking backend's ``tokens`` (:meth:`push` each), up to a stop string; the caller closes
        ``tokens`` and adds :meth:`finish`.
        """
        for token in tokens:
            if chunk := self.push(token):
                yield chunk
            if self.stopped:
                return

    def _pending_logprobs(self) -> tuple[TokenLogprob, ...] | None:
        """The log-probabilities of the tokens not yet in a chunk (None when the request did not ask)."""
        return self.logprobs.take() if self.logprobs is not None else None

    def finish(self) -> StreamChunk:
        """The last chunk: remaining text, finish reason, stats and the full result."""
        finished_at = time.perf_counter()
        first_token_at = self._first_token_at or finished_at
        stopped = self.text.stopped or len(self.tokens) < self.params.max_new_tokens
        stats = self._stats(first_token_at, finished_at)
        tail, calls = self.calls.finish(self.text.finish())
        reason: FinishReason = "stop" if stopped else "length"
        if self.calls.calls and (stopped or not self.calls.invalid):  # cut inside a call: "length", as OpenAI's
            reason = "tool_calls"
        text = self.calls.content if self.calls.parsing else self.text.emitted
        every = tuple(self.logprobs.every) if self.logprobs is not None else None
        result = GenerationResult(
            text, self.tokens, reason, stats, self.kept, tuple(self.calls.calls), tuple(self.calls.invalid), every
        )
        return StreamChunk(tail, self._pending, result.finish_reason, stats, result, calls, self._pending_logprobs())

    def _stats(self, first_token_at: float, finished_at: float) -> SpecPrefillStats:
        tokens = self.tokens
        decode_s = finished_at - first_token_at
        return SpecPrefillStats(
            **selected(self.layout, self.selection, self.draft_path),
            main_prefill_ms=(first_token_at - self._prefill_started) * 1000.0,
            ttft_ms=(first_token_at - self.started) * 1000.0,
            completion_tokens=len(tokens),
            decode_tokens_per_s=(len(tokens) - 1) / decode_s if len(tokens) > 1 and decode_s > 0 else 0.0,
            main_cached_tokens=self.report.cached_tokens,
        )


class _LogprobCollector:
    """The typed log-probabilities of a request's tokens: the backend's :class:`StepLogprobs` (in the report it
    fills) with each token's text and bytes.
    """

    def __init__(self, tokenizer: Any, report: PrefillReport) -> None:
        self._pieces = TokenPieces(tokenizer)
        self._report = report
        self.every: list[TokenLogprob] = []
        self._pending: list[TokenLogprob] = []

    def push(self, index: int, token: int) -> None:
        """Add the generated token ``index`` (``token``)."""
        steps = self._report.logprobs
        if index >= len(steps) or steps[index].token_id != token:
            raise SpecPrefillError(
                f"the main backend did not report the log-probabilities of generated token {index} ({token}); "
                "use a backend that fills PrefillReport.logprobs, or send the request without logprobs"
            )
        typed = self._typed(steps[index])
        self.every.append(typed)
        self._pending.append(typed)

    def take(self) -> tuple[TokenLogprob, ...]:
        """The log-probabilities added since the last call."""
        taken, self._pending = tuple(self._pending), []
        return taken

    def _typed(self, step: StepLogprobs) -> TokenLogprob:
        top = tuple(self._top(token, logprob) for token, logprob in zip(step.top_ids, step.top_logprobs))
        text, raw = self._pieces(step.token_id)
        return TokenLogprob(text, step.token_id, step.logprob, raw, top)

    def _top(self, token: int, logprob: float) -> TopLogprob:
        text, raw = self._pieces(token)
        return TopLogprob(text, token, logprob, raw)


class _CallCollector:
    """The answer's tool calls, parsed from its text as it streams (``params.tool_format``), each naming one of
    ``params.tool_names`` (a call of another tool stays content); with no format, text passes through untouched.
    With ``parallel_tool_calls=False`` every call after the first is an
    invalid call (reported, not dropped).
    """

    def __init__(self, params: GenerationParams) -> None:
        self.parsing = params.tool_format is not None
        fmt, offered = params.tool_format, params.tool_names
        self._stream = ToolCallStream(fmt, offered=offered) if fmt is not None else None
        self._parallel = params.parallel_tool_calls
        output = params.output_format
        # the answer is nothing but calls (a lazy format, tool_choice="auto", allows text too)
        self._forced = output is not None and output.kind == "tool_call" and not output.lazy
        self.content = ""
        self.calls: list[ToolCall] = []
        self.invalid: list[InvalidToolCall] = []

    def push(self, delta: str) -> tuple[str, tuple[ToolCall, ...]]:
        """Text that is certainly not markup, and the calls completed by ``delta``."""
        if self._stream is None:
            return delta, ()
        return self._take(self._stream.push(delta)) if delta else ("", ())

    def finish(self, tail: str) -> tuple[str, tuple[ToolCall, ...]]:
        """The rest of the text and calls, ``tail`` being the last text delta."""
        if self._stream is None:
            return tail, ()
        content, calls = self._take(self._stream.push(tail)) if tail else ("", ())
        last_content, last_calls = self._take(self._stream.finish())
        if self._forced and last_content.strip():  # held-back markup of a call cut off by max_new_tokens
            self.content = self.content[: len(self.content) - len(last_content)]
            self.invalid.append(InvalidToolCall(None, last_content, new_call_id(), "unterminated"))
            last_content = ""
        return content + last_content, calls + last_calls

    def _take(self, part: StreamedPart) -> tuple[str, tuple[ToolCall, ...]]:
        self.content += part.content
        self.invalid += part.invalid_tool_calls
        calls = []
        for call in part.tool_calls:
            if self.calls and not self._parallel:
                error = "a second call while parallel_tool_calls is false"
                self.invalid.append(InvalidToolCall(call.name, json.dumps(dict(call.arguments)), call.id, error))
            else:
                self.calls.append(call)
                calls.append(call)
        return part.content, tuple(calls)


def selected(layout: PromptLayout, selection: Selection, draft_path: DraftPath | None) -> dict[str, Any]:
    """The stats known before the first token: what was kept, and what choosing it cost."""
    kept = selection.kept
    return {
        "prompt_tokens": len(layout),
        "document_tokens": layout.n_document_tokens,
        "kept_tokens": int(kept.numel()),
        "kept_document_tokens": int((layout.document_index[kept] >= 0).sum()),
        "keep_rate": keep_rate(layout, kept),
        "compressed": int(kept.numel()) < len(layout),
        "draft_ms": selection.draft_ms,
        "draft_path": draft_path,
        "draft_cached_tokens": selection.draft_cached_tokens,
        "keep_policy": selection.keep_policy,
        "reused_spans": selection.reused_spans,
        "draft_document_cached_tokens": selection.draft_document_cached_tokens,
        "draft_documents_cached": selection.draft_documents_cached,
        "uncompressed_reason": selection.uncompressed_reason,
    }


def keep_rate(layout: PromptLayout, kept: torch.Tensor) -> float:
    """Kept document tokens over document tokens (1.0 without documents)."""
    documents = layout.n_document_tokens
    return float((layout.document_index[kept] >= 0).sum()) / documents if documents else 1.0


def last_result(chunks: Iterator[StreamChunk]) -> GenerationResult:
    """Run a stream to its end; the result its last chunk carries."""
    result = None
    for chunk in chunks:
        result = chunk.result
    assert result is not None  # the last chunk always carries the result
    return result


async def alast_result(chunks: AsyncGenerator[StreamChunk, None]) -> GenerationResult:
    """:func:`last_result` for an async stream (closed even when cancelled)."""
    result = None
    async with aclosing(chunks):
        async for chunk in chunks:
            result = chunk.result
    assert result is not None  # the last chunk always carries the result
    return result
