"""Output constrained to a JSON schema, any JSON object or tool calls, for the in-process decode loop.

A :class:`ConstraintCompiler` is built once per tokenizer; it checks an :class:`OutputFormat` against the
:class:`~specprefill_rag.config.GrammarLimits` (:mod:`~specprefill_rag.decode.schema_limits`), compiles it into an
xgrammar grammar (kept in an LRU bounded in bytes) and hands each request a fresh :class:`TokenConstraint`, whose
:meth:`~TokenConstraint.mask_` sets the logits of every token the format forbids to ``-inf`` before the
next token is chosen, and whose :meth:`~TokenConstraint.accept` advances it with the chosen token::

    constraint = compiler.constraint(OutputFormat("json_schema", schema=schema))
    while not constraint.finished:
        constraint.mask_(logits)                      # [V]
        token = next_token(logits, temperature, top_p, generator)
        constraint.accept(token)                      # an end-of-sequence token terminates it
        ...

The tokenizer's special tokens (``<|im_start|>``, ``<|endoftext|>``, ...) are never allowed as text: only
the stop tokens, and only where the output is complete. Tool-call markers that are single tokens of the
vocabulary (Qwen's ``<tool_call>``, Mistral's ``[TOOL_CALLS]``) are forced as that one token, the way the
model was trained to write them. The tool-call grammar is
:func:`~specprefill_rag.decode.formats.tool_call_structural_tag`'s, the one a vLLM main enforces too. JSON may
carry whitespace between its elements, at most :data:`MAX_WHITESPACE` characters in a row, so a small model
cannot run away in newlines.

xgrammar is the ``constrained`` extra: ``pip install 'specprefill-rag[constrained]'``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

import torch

from ..config import GrammarLimits, OutputFormat
from ..errors import InvalidRequestError, OutputFormatError
from .formats import TOOL_MARKERS, as_json, marker_tokens, tool_call_structural_tag, validate_format
from .schema_limits import check_format_limits

try:
    import xgrammar as xgr
except ImportError:  # the `constrained` extra is not installed (mypy then sees no module: unused-ignore)
    xgr = None  # type: ignore[assignment, unused-ignore]

INSTALL_HINT = "pip install 'specprefill-rag[constrained]'"
# Longest run of whitespace allowed between JSON elements (keys, values, separators).
MAX_WHITESPACE = 16


def _require_xgrammar() -> None:
    if xgr is None:
        raise InvalidRequestError(f"constrained output (response_format, tools) needs xgrammar: {INSTALL_HINT}")


def _special_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokenizer's special tokens (control tokens such as ``<|im_start|>``)."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", ()) if i is not None}
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(int(index) for index, added in decoder.items() if getattr(added, "special", False))
    return ids


def tokenizer_info(tokenizer: Any, vocab_size: int, stop_token_ids: list[int] | None, visible: set[int]) -> Any:
    """xgrammar's view of ``tokenizer`` over ``vocab_size`` ids, its special tokens hidden.

    xgrammar matches every token by its text, special tokens included, so ``<|endoftext|>`` could be written
    inside a JSON string (and end a decode loop that stops on it). Special tokens other than ``visible``
    are given an empty text, which makes xgrammar treat them as never allowed; the stop tokens stay
    allowed where the output is complete. Ids at or above the tokenizer's size (padding of the logits) are
    never allowed.
    """
    assert xgr is not None
    base = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids)
    hidden = _special_ids(tokenizer) - visible
    if not hidden:
        return base
    vocabulary = tokenizer.get_vocab()
    blank: str | bytes = b"" if any(isinstance(token, bytes) for token in vocabulary) else ""
    encoded: list[Any] = [blank] * vocab_size
    for token, index in vocabulary.items():
        if index < vocab_size and index not in hidden:
            encoded[index] = token
    return xgr.TokenizerInfo.from_vocab_and_metadata(encoded, base.dump_metadata())


class ConstraintCompiler:
    """Compiles output formats for one tokenizer; thread-safe.

    Builds xgrammar's tokenizer info once, over ``vocab_size`` ids (the main model's logits width, which
    can exceed ``len(tokenizer)``), and keeps the compiled grammars last used, keyed by
    :meth:`OutputFormat.canonical_json`, up to ``limits.grammar_cache_mb`` of their memory
    (``CompiledGrammar.memory_size_bytes``). A format over one of ``limits`` is refused before compiling.

    Args:
        tokenizer: the main model's Hugging Face tokenizer.
        vocab_size: ``V``, the width of the logits.
        limits: the bounds on a format and on the cache (default: :class:`~specprefill_rag.config.GrammarLimits`'s).
        cache_bytes: the cache's bound in bytes, instead of ``limits.grammar_cache_mb``.
        stop_token_ids: the ids that end generation (the decode loop's end-of-sequence ids); default the
            tokenizer's ``eos_token_id``. Only these are allowed once the output is complete.
    """

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        limits: GrammarLimits | None = None,
        *,
        stop_token_ids: Iterable[int] | None = None,
        cache_bytes: int | None = None,
    ) -> None:
        _require_xgrammar()
        assert xgr is not None
        self.vocab_size = vocab_size
        self.limits = limits or GrammarLimits()
        self.max_cache_bytes = cache_bytes if cache_bytes is not None else self.limits.grammar_cache_mb * 2**20
        self.compiles = 0  # grammars compiled (not served from the cache)
        stops = sorted({int(i) for i in stop_token_ids}) if stop_token_ids is not None else None
        self._markers = marker_tokens(tokenizer, vocab_size, TOOL_MARKERS)
        self._info = tokenizer_info(tokenizer, vocab_size, stops or None, set(self._markers.values()))
        # xgrammar's own cache is unbounded; this class bounds its cache in bytes instead.
        self._compiler = xgr.GrammarCompiler(self._info, cache_enabled=False)
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self._cache_bytes = 0
        self._lock = threading.Lock()

    @property
    def stop_token_ids(self) -> list[int]:
        """The ids allowed, and only they, once an output is complete."""
        return list(self._info.stop_token_ids)

    @property
    def cached(self) -> int:
        """How many compiled grammars the cache holds."""
        with self._lock:
            return len(self._cache)

    @property
    def cache_bytes(self) -> int:
        """The memory of the compiled grammars the cache holds, in bytes (at most ``max_cache_bytes``)."""
        with self._lock:
            return self._cache_bytes

    def constraint(self, fmt: OutputFormat) -> TokenConstraint:
        """A fresh grammar state for one request; InvalidRequestError for a malformed or uncompilable format."""
        return TokenConstraint(self.compiled(fmt), self.vocab_size, fmt.kind)

    def compiled(self, fmt: OutputFormat) -> Any:
        """The ``xgrammar.CompiledGrammar`` of ``fmt``, from the cache or compiled now (and cached).

        :class:`~specprefill_rag.errors.OutputFormatError` when ``fmt`` passes one of the limits (checked
        first, so a schema nested past Python's recursion limit is refused rather than serialised).
        """
        check_format_limits(fmt, self.limits)
        validate_format(fmt)
        key = fmt.canonical_json()
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = self._compile(fmt)  # outside the lock: other formats compile meanwhile
        self._keep(key, grammar)
        return grammar

    def _keep(self, key: str, grammar: Any) -> None:
        """Cache ``grammar``, dropping the least recently used past ``max_cache_bytes`` (one larger than the
        whole bound is used, not kept).
        """
        size = int(grammar.memory_size_bytes)
        with self._lock:
            self.compiles += 1
            if size > self.max_cache_bytes or key in self._cache:
                return
            self._cache[key] = grammar
            self._cache_bytes += size
            while self._cache_bytes > self.max_cache_bytes:
                _, dropped = self._cache.popitem(last=False)
                self._cache_bytes -= int(dropped.memory_size_bytes)

    def _compile(self, fmt: OutputFormat) -> Any:
        try:
            if fmt.kind == "tool_call":
                tag = tool_call_structural_tag(fmt, self._markers)
                return self._compiler.compile_structural_tag(json.dumps(tag))
            return self._compiler.compile_json_schema(_schema_text(fmt), **_json_options(fmt))
        except InvalidRequestError:
            raise
        except Exception as error:  # xgrammar raises RuntimeError, ValueError and pydantic's errors
            raise _not_compiled(fmt, error) from error


def json_grammar(fmt: OutputFormat, limits: GrammarLimits | None = None) -> str:
    """The EBNF grammar of a ``json_object`` or ``json_schema`` ``fmt``, as :class:`ConstraintCompiler` compiles it
    (``strict`` or not, at most :data:`MAX_WHITESPACE` whitespace characters in a row): for a server that
    compiles grammars itself (a vLLM main, whose own JSON option is always strict). ``limits`` are checked first.
    """
    _require_xgrammar()
    check_format_limits(fmt, limits or GrammarLimits())
    validate_format(fmt)
    try:
        return str(xgr.Grammar.from_json_schema(_schema_text(fmt), **_json_options(fmt)))
    except InvalidRequestError:
        raise
    except Exception as error:
        raise _not_compiled(fmt, error) from error


def _schema_text(fmt: OutputFormat) -> str:
    schema = {"type": "object"} if fmt.kind == "json_object" else as_json(fmt.schema, "the JSON schema")
    return json.dumps(schema)


def _json_options(fmt: OutputFormat) -> dict[str, Any]:
    return {"any_whitespace": True, "max_whitespace_cnt": MAX_WHITESPACE, "strict_mode": fmt.strict}


def _not_compiled(fmt: OutputFormat, error: Exception) -> InvalidRequestError:
    reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
    return InvalidRequestError(f"the {fmt.kind} output format cannot be compiled: {reason}")


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's ``[ceil(V/32)]`` int32 bitmask (bit ``j`` of word ``i``: token ``32i+j`` allowed) as ``[V]`` bool."""
    bits = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> bits) & 1).view(-1)[:vocab_size].bool()


class TokenConstraint:
    """One request's grammar state: which tokens may come next, advanced token by token.

    Not thread-safe; a request uses its own from one thread at a time.

    A state where no token may follow, not even a stop token (a dead end of the grammar: a pattern that matches
    nothing), raises :class:`~specprefill_rag.errors.OutputFormatError` from :meth:`allowed`/:meth:`mask_`: the
    request fails as bad input (a 400 at the gateway) rather than sampling from logits that are all ``-inf``.

    Args:
        grammar: an ``xgrammar.CompiledGrammar`` (from :meth:`ConstraintCompiler.compiled`).
        vocab_size: ``V``, the width of the logits.
        kind: the format's kind, for the error messages.
    """

    def __init__(self, grammar: Any, vocab_size: int, kind: str = "constrained") -> None:
        _require_xgrammar()
        assert xgr is not None
        self.vocab_size = vocab_size
        self.kind = kind
        self.accepted = 0  # tokens accepted so far
        self._matcher = xgr.GrammarMatcher(grammar)
        self._bitmask = xgr.allocate_token_bitmask(1, vocab_size)  # [1, ceil(V/32)] int32
        self._stop_ids = torch.tensor(sorted(self._matcher.stop_token_ids), dtype=torch.long)
        self._filled = False  # the bitmask holds the current state's allowed tokens

    def _fill(self) -> None:
        if self._matcher.is_terminated():
            raise RuntimeError("the constrained output already ended with a stop token; no token may follow")
        if not self._filled:
            self._matcher.fill_next_token_bitmask(self._bitmask)
            self._filled = True
            if not bool(self._bitmask.any()):
                raise self._dead_end()

    def _dead_end(self) -> OutputFormatError:
        """No token may come next, nor a stop token: a part of the format nothing can match."""
        return OutputFormatError(
            f"the {self.kind} output format cannot be completed: after {self.accepted} tokens no token, and no end, "
            "may follow (a part of it matches nothing, e.g. a pattern no string matches, or one the vocabulary's "
            "tokens cannot spell); fix that part of the schema",
            kind=self.kind,
        )

    def allowed(self) -> torch.Tensor:
        """``[V]`` bool on the CPU: the tokens that may come next."""
        self._fill()
        return unpack_bitmask(self._bitmask[0], self.vocab_size)

    def mask_(self, logits: torch.Tensor) -> None:
        """Set the ``[V]`` float ``logits`` (any device or dtype) of disallowed tokens to ``-inf``, in place."""
        if logits.shape != (self.vocab_size,):
            raise ValueError(f"expected logits of shape [{self.vocab_size}], got {list(logits.shape)}")
        self._fill()
        assert xgr is not None
        if logits.device.type == "cpu" and logits.dtype == torch.float32 and logits.is_contiguous():
            xgr.apply_token_bitmask_inplace(logits, self._bitmask)  # native CPU kernel
            return
        allowed = unpack_bitmask(self._bitmask[0].to(logits.device), self.vocab_size)
        with torch.inference_mode():  # logits of a forward pass under inference_mode are inference tensors
            logits.masked_fill_(~allowed, float("-inf"))

    def accept(self, token: int) -> None:
        """Advance with the chosen ``token``; RuntimeError when the format does not allow it (a bug: mask first)."""
        if self._matcher.is_terminated() or not self._matcher.accept_token(int(token)):
            raise RuntimeError(f"token {token} is not allowed by the output format here; mask the logits first")
        self._filled = False
        self.accepted += 1

    @property
    def finished(self) -> bool:
        """The output is complete: a stop token was accepted, or nothing but a stop token may come next."""
        if self._matcher.is_terminated():
            return True
        if not self._matcher.is_completed():
            return False
        allowed = self.allowed()
        allowed[self._stop_ids[self._stop_ids < self.vocab_size]] = False
        return not bool(allowed.any())
