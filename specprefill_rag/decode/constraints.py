"""Output constrained to a JSON schema, any JSON object or tool calls, for the in-process decode loop.

A :class:`ConstraintCompiler` is built once per tokenizer; it compiles an :class:`OutputFormat` into an
xgrammar grammar (kept in a bounded LRU) and hands each request a fresh :class:`TokenConstraint`, whose
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
model was trained to write them. JSON may carry whitespace between its elements, at most
:data:`MAX_WHITESPACE` characters in a row, so a small model cannot run away in newlines.

xgrammar is the ``constrained`` extra: ``pip install 'specprefill-rag[constrained]'``.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from ..config import OutputFormat
from ..errors import InvalidRequestError

try:
    import xgrammar as xgr
except ImportError:  # the `constrained` extra is not installed (mypy then sees no module: unused-ignore)
    xgr = None  # type: ignore[assignment, unused-ignore]

INSTALL_HINT = "pip install 'specprefill-rag[constrained]'"
# Longest run of whitespace allowed between JSON elements (keys, values, separators).
MAX_WHITESPACE = 16
# In tool-call arguments: one character (the families' own format is json.dumps's, `{"a": 1, "b": 2}`), so
# the call stays short and a small model spends its tokens on the arguments, not on layout.
CALL_WHITESPACE = 1
TOOL_FORMATS = ("hermes", "llama3", "mistral")
# Markup of each tool-call family: text before and after one call, the separator between calls, and the
# text around the whole list. A marker that is one token of the vocabulary is forced as that token.
_CALL_OPEN = {"hermes": "<tool_call>", "llama3": "", "mistral": ""}
_CALL_CLOSE = {"hermes": "</tool_call>", "llama3": "", "mistral": ""}
_ARGUMENTS_KEY = {"hermes": "arguments", "llama3": "parameters", "mistral": "arguments"}
_SEPARATOR = {"hermes": "\n", "llama3": "; ", "mistral": ", "}
_LIST_OPEN = {"hermes": "", "llama3": "", "mistral": "[TOOL_CALLS]"}
_MARKERS = ("<tool_call>", "</tool_call>", "[TOOL_CALLS]")
_NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}


def validate_format(fmt: OutputFormat) -> None:
    """Raise :class:`~specprefill_rag.errors.InvalidRequestError` for a malformed format, before compiling.

    Checks the fields each kind needs and forbids the ones it does not use; a schema must be a JSON object
    (a dict) that serialises to JSON; tools need ``function.name`` (unique) and an object ``parameters``.
    """
    if fmt.kind not in ("json_object", "json_schema", "tool_call"):
        raise InvalidRequestError(
            f"unknown output format kind {fmt.kind!r}; use 'json_object', 'json_schema' or 'tool_call'"
        )
    if fmt.kind != "json_schema" and fmt.schema is not None:
        raise InvalidRequestError(f"`schema` is for kind='json_schema', not kind={fmt.kind!r}")
    if fmt.kind != "tool_call" and (fmt.tools or fmt.tool_format is not None):
        raise InvalidRequestError(f"`tools` and `tool_format` are for kind='tool_call', not kind={fmt.kind!r}")
    if fmt.kind == "json_schema":
        if not isinstance(fmt.schema, Mapping):
            raise InvalidRequestError(
                f"kind='json_schema' needs `schema`, a JSON Schema object (a dict); got {type(fmt.schema).__name__}"
            )
        _as_json(fmt.schema, "the JSON schema")
    elif fmt.kind == "tool_call":
        if fmt.tool_format not in TOOL_FORMATS:
            raise InvalidRequestError(
                f"kind='tool_call' needs `tool_format`, one of {', '.join(TOOL_FORMATS)}; got {fmt.tool_format!r}"
            )
        if not fmt.tools:
            raise InvalidRequestError("kind='tool_call' needs at least one tool in `tools`")
        names = [name for name, _ in _tools(fmt)]
        duplicated = sorted({name for name in names if names.count(name) > 1})
        if duplicated:
            raise InvalidRequestError(f"tool names must be unique; {', '.join(map(repr, duplicated))} repeat")


def _as_json(value: Any, what: str) -> Any:
    """``value`` as plain JSON data (dicts, lists, ...), or InvalidRequestError when it is not JSON."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as error:
        raise InvalidRequestError(f"{what} is not JSON-serialisable: {error}") from error


def _tools(fmt: OutputFormat) -> list[tuple[str, dict[str, Any]]]:
    """``(name, parameters schema)`` of each tool of a tool_call format, checked."""
    return [_tool(index, tool) for index, tool in enumerate(fmt.tools)]


def _tool(index: int, tool: Any) -> tuple[str, dict[str, Any]]:
    """One OpenAI tool schema's name and parameters (the empty object when it takes none)."""
    if not isinstance(tool, Mapping) or tool.get("type", "function") != "function":
        raise InvalidRequestError(
            f'tool {index} must be {{"type": "function", "function": {{"name": ..., "parameters": ...}}}}'
        )
    function = tool.get("function")
    if not isinstance(function, Mapping) or not isinstance(function.get("name"), str) or not function["name"]:
        raise InvalidRequestError(f"tool {index} has no `function.name` (a non-empty string)")
    name: str = function["name"]
    parameters = function.get("parameters")
    if parameters is None or (isinstance(parameters, Mapping) and not parameters):
        return name, dict(_NO_PARAMETERS)
    if not isinstance(parameters, Mapping) or parameters.get("type") != "object":
        got = parameters.get("type") if isinstance(parameters, Mapping) else type(parameters).__name__
        raise InvalidRequestError(
            f'the parameters of tool {name!r} must be an object schema ({{"type": "object", "properties": '
            f"...}}); got {got!r}"
        )
    return name, _as_json(parameters, f"the parameters of tool {name!r}")


def _require_xgrammar() -> None:
    if xgr is None:
        raise InvalidRequestError(f"constrained output (response_format, tools) needs xgrammar: {INSTALL_HINT}")


def _special_ids(tokenizer: Any) -> set[int]:
    """Ids of the tokenizer's special tokens (control tokens such as ``<|im_start|>``)."""
    ids = {int(i) for i in getattr(tokenizer, "all_special_ids", ()) if i is not None}
    decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    ids.update(int(index) for index, added in decoder.items() if getattr(added, "special", False))
    return ids


def _single_tokens(tokenizer: Any, texts: Iterable[str], vocab_size: int) -> dict[str, int]:
    """Each of ``texts`` that the tokenizer writes as exactly one token (below ``vocab_size``), with its id."""
    found = {}
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False)
        if len(ids) == 1 and 0 <= ids[0] < vocab_size:
            found[text] = int(ids[0])
    return found


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
    can exceed ``len(tokenizer)``), and keeps the last ``max_cached`` compiled grammars, keyed by
    :meth:`OutputFormat.canonical_json`.

    Args:
        tokenizer: the main model's Hugging Face tokenizer.
        vocab_size: ``V``, the width of the logits.
        max_cached: how many compiled grammars to keep (least recently used dropped first).
        stop_token_ids: the ids that end generation (the decode loop's end-of-sequence ids); default the
            tokenizer's ``eos_token_id``. Only these are allowed once the output is complete.
    """

    def __init__(
        self, tokenizer: Any, vocab_size: int, max_cached: int = 64, *, stop_token_ids: Iterable[int] | None = None
    ) -> None:
        _require_xgrammar()
        assert xgr is not None
        if max_cached < 1:
            raise ValueError(f"max_cached must be at least 1, got {max_cached}")
        self.vocab_size = vocab_size
        self.max_cached = max_cached
        stops = sorted({int(i) for i in stop_token_ids}) if stop_token_ids is not None else None
        self._markers = _single_tokens(tokenizer, _MARKERS, vocab_size)
        self._info = tokenizer_info(tokenizer, vocab_size, stops or None, set(self._markers.values()))
        # xgrammar's own cache is unbounded; this class bounds the cache by count instead.
        self._compiler = xgr.GrammarCompiler(self._info, cache_enabled=False)
        self._cache: OrderedDict[str, Any] = OrderedDict()
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

    def constraint(self, fmt: OutputFormat) -> TokenConstraint:
        """A fresh grammar state for one request; InvalidRequestError for a malformed or uncompilable format."""
        return TokenConstraint(self.compiled(fmt), self.vocab_size)

    def compiled(self, fmt: OutputFormat) -> Any:
        """The ``xgrammar.CompiledGrammar`` of ``fmt``, from the cache or compiled now (and cached)."""
        validate_format(fmt)
        key = fmt.canonical_json()
        with self._lock:
            grammar = self._cache.get(key)
            if grammar is not None:
                self._cache.move_to_end(key)
                return grammar
        grammar = self._compile(fmt)  # outside the lock: other formats compile meanwhile
        with self._lock:
            self._cache[key] = grammar
            self._cache.move_to_end(key)
            while len(self._cache) > self.max_cached:
                self._cache.popitem(last=False)
        return grammar

    def _compile(self, fmt: OutputFormat) -> Any:
        try:
            if fmt.kind == "tool_call":
                return self._compiler.compile_structural_tag(self._tool_call_tag(fmt))
            schema = {"type": "object"} if fmt.kind == "json_object" else _as_json(fmt.schema, "the JSON schema")
            return self._compiler.compile_json_schema(
                json.dumps(schema),
                any_whitespace=True,
                max_whitespace_cnt=MAX_WHITESPACE,
                strict_mode=fmt.strict,
            )
        except InvalidRequestError:
            raise
        except Exception as error:  # xgrammar raises RuntimeError, ValueError and pydantic's errors
            reason = str(error).strip().splitlines()[-1] if str(error).strip() else type(error).__name__
            raise InvalidRequestError(f"the {fmt.kind} output format cannot be compiled: {reason}") from error

    def _text(self, text: str) -> Any:
        """A structural-tag piece for fixed text: the single token when ``text`` is a marker token."""
        assert xgr is not None
        if text in self._markers:
            return xgr.structural_tag.TokenFormat(token=self._markers[text])
        return xgr.structural_tag.ConstStringFormat(value=text)

    def _call(self, family: str, name: str, parameters: dict[str, Any]) -> Any:
        """One tool call of ``family`` naming ``name``, its arguments valid for ``parameters``."""
        assert xgr is not None
        tags = xgr.structural_tag
        newline = "\n" if family == "hermes" else ""
        head = f'{newline}{{"name": {json.dumps(name, ensure_ascii=False)}, "{_ARGUMENTS_KEY[family]}": '
        pieces = [
            tags.ConstStringFormat(value=head),
            tags.JSONSchemaFormat(json_schema=parameters, max_whitespace_cnt=CALL_WHITESPACE),
            tags.ConstStringFormat(value="}" + newline),
        ]
        if _CALL_OPEN[family]:
            pieces.insert(0, self._text(_CALL_OPEN[family]))
        if _CALL_CLOSE[family]:
            pieces.append(self._text(_CALL_CLOSE[family]))
        return tags.SequenceFormat(elements=pieces)

    def _tool_call_tag(self, fmt: OutputFormat) -> Any:
        """The structural tag of a tool_call format: one call, or calls joined by the family's separator."""
        assert xgr is not None and fmt.tool_format is not None
        tags = xgr.structural_tag
        family = fmt.tool_format
        calls = [self._call(family, name, parameters) for name, parameters in _tools(fmt)]
        one = calls[0] if len(calls) == 1 else tags.OrFormat(elements=calls)
        body = one
        if fmt.parallel:
            more = tags.SequenceFormat(elements=[tags.ConstStringFormat(value=_SEPARATOR[family]), one])
            body = tags.SequenceFormat(elements=[one, tags.StarFormat(content=more)])
        if family == "mistral":
            opening, closing = tags.ConstStringFormat(value="["), tags.ConstStringFormat(value="]")
            body = tags.SequenceFormat(elements=[self._text(_LIST_OPEN[family]), opening, body, closing])
        return xgr.StructuralTag(format=body)


def unpack_bitmask(words: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """xgrammar's ``[ceil(V/32)]`` int32 bitmask (bit ``j`` of word ``i``: token ``32i+j`` allowed) as ``[V]`` bool."""
    bits = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> bits) & 1).view(-1)[:vocab_size].bool()


class TokenConstraint:
    """One request's grammar state: which tokens may come next, advanced token by token.

    Not thread-safe; a request uses its own from one thread at a time.

    Args:
        grammar: an ``xgrammar.CompiledGrammar`` (from :meth:`ConstraintCompiler.compiled`).
        vocab_size: ``V``, the width of the logits.
    """

    def __init__(self, grammar: Any, vocab_size: int) -> None:
        _require_xgrammar()
        assert xgr is not None
        self.vocab_size = vocab_size
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
