"""Tool calls in a model's generated text, per model family: blocking (:func:`parse_tool_calls`) and
streamed (:class:`ToolCallStream`).

:func:`tool_call_format` picks the family from the chat template:

- ``hermes`` (Qwen2.5, Qwen3, Hermes, SmolLM3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``
  blocks, possibly after some text; also a call written without markup, as small models do (and as the lazy
  grammar of ``tool_choice="auto"`` completes it): a JSON object ``{"name": "<tool>", "arguments": {...}}``
  (those two keys, or ``parameters``) among the text, alone, inside doubled braces (``{{...}}``, copied from
  Qwen2.5's chat template) or a json fence, which go with it;
- ``llama3`` (Llama 3.1 to 3.3 JSON tool calling): the whole output, after an optional ``<|python_tag|>``, is
  ``{"name": ..., "parameters": {...}}`` or several such objects separated by ``;``;
- ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]``, or the newer
  ``[TOOL_CALLS]name[ARGS]{...}``, possibly repeated.

Content is the text outside the markup. Whitespace next to removed markup is trimmed, and the pieces of text on
either side of removed calls are joined by a blank line. A call the model wrote that cannot be decoded is an
:class:`InvalidToolCall`, never an exception and never dropped; so is a call written without markup that the text
ends inside (``max_tokens`` cut it off) once it has named an offered tool. Given the ``offered`` tool names, a
call (valid or not) naming any other tool is no call at all: its text stays content, as written (its JSON
re-serialised for a call inside a Mistral list), so text that a tool result or a document smuggled into the
answer never becomes a call of a tool the client did not offer. Arguments must be a JSON object; they are not
validated against the tool's ``parameters`` schema here (a forced ``tool_choice`` constrains them to it while
they are generated). The blocking parser is the streaming one fed the whole text at once, so both give the same
content, calls and ids however the text is split.
"""

from __future__ import annotations

import json
import re
import secrets
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any, Literal

from ..config import ToolCallFormat
from ..errors import InvalidRequestError
from ..prompt.tools import tool_call_format
from ..results import InvalidToolCall, ToolCall

_HERMES_OPEN = "<tool_call>"
_HERMES_CLOSE = "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
_MISTRAL_CALLS = "[TOOL_CALLS]"
_MISTRAL_ARGS = "[ARGS]"
_SEPARATOR = "\n\n"  # between content pieces that removed calls stood between
# How a hermes call written without markup starts: ``{"name":``, compact or pretty-printed (``{\n  "name": ``,
# as small models write it inside a json fence); and any start of it at the end of the text, held back while
# streaming.
_TEXT_CALL = re.compile(r'\{\s*"name"\s*:')
_TEXT_CALL_START = re.compile(r'\{\s*(?:"(?:n(?:a(?:m(?:e(?:"\s*)?)?)?)?)?)?\Z')
# Before such a call: a json fence and/or the extra brace of doubled braces (complete; and any start of them,
# held back while streaming).
_WRAPPER = re.compile(r"(```(?:json)?\s*)?(\{\s*)?\Z")
_WRAPPER_START = re.compile(r"(?:`{1,3}(?:j(?:s(?:o(?:n)?)?)?)?\s*)?(?:\{\s*)?\Z")
_JSON = json.JSONDecoder()
# Deepest JSON a call may nest: a model can write JSON nested past Python's recursion limit (a forced call whose
# parameters allow any object), which json cannot decode, nor encode again into the response (issue #43).
MAX_CALL_DEPTH = 256


def _raw_decode(text: str) -> tuple[Any, int]:
    """``json.JSONDecoder().raw_decode(text)``; JSON nested deeper than :data:`MAX_CALL_DEPTH` levels is malformed
    (a ``JSONDecodeError``), never a ``RecursionError``.
    """
    try:
        value, end = _JSON.raw_decode(text)
    except RecursionError:
        value, end = None, -1
    if end < 0 or _depth(value) > MAX_CALL_DEPTH:
        raise json.JSONDecodeError(f"nested deeper than {MAX_CALL_DEPTH} levels", text, 0)
    return value, end


def _loads(text: str) -> Any:
    """``json.loads(text)``, bounded in depth as :func:`_raw_decode` is."""
    value, end = _raw_decode(text.lstrip())
    if text.lstrip()[end:].strip():
        raise json.JSONDecodeError("Extra data", text, end)
    return value


def _depth(value: Any) -> int:
    """How deep ``value``'s lists and dicts nest (iteratively)."""
    deepest, stack = 0, [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, (dict, list)):
            deepest = max(deepest, depth)
            stack.extend((child, depth + 1) for child in (item.values() if isinstance(item, dict) else item))
    return deepest


@dataclass(frozen=True)
class ParsedOutput:
    """A whole output split into content and tool calls.

    Attributes:
        content: the text outside tool-call markup, with the whitespace next to removed markup trimmed; ``""``
            if none.
        tool_calls: the decoded calls, in the order written.
        invalid_tool_calls: the calls that could not be decoded, in the order written.
    """

    content: str
    tool_calls: tuple[ToolCall, ...]
    invalid_tool_calls: tuple[InvalidToolCall, ...]


@dataclass(frozen=True)
class StreamedPart:
    """What one :meth:`ToolCallStream.push` or :meth:`ToolCallStream.finish` released.

    Attributes:
        content: content now certain not to be tool-call markup (possibly ``""``).
        tool_calls: the calls completed by this delta.
        invalid_tool_calls: the undecodable calls completed by this delta.
    """

    content: str
    tool_calls: tuple[ToolCall, ...]
    invalid_tool_calls: tuple[InvalidToolCall, ...] = ()


__all__ = ["ParsedOutput", "StreamedPart", "ToolCallStream", "marker_tokens", "parse_tool_calls", "tool_call_format"]

MARKERS: dict[ToolCallFormat, tuple[str, ...]] = {
    "hermes": (_HERMES_OPEN, _HERMES_CLOSE),
    "llama3": (_PYTHON_TAG,),
    "mistral": (_MISTRAL_CALLS, _MISTRAL_ARGS),
}


def marker_tokens(tokenizer: Any, fmt: ToolCallFormat | None) -> dict[int, str]:
    """The family's markup that the tokenizer holds as single added tokens, id -> text: decoded into the answer's
    text even when special (Mistral's ``[TOOL_CALLS]``), so the parser sees it.
    """
    if fmt is None:
        return {}
    added = {str(token): int(i) for i, token in getattr(tokenizer, "added_tokens_decoder", {}).items()}
    return {added[marker]: marker for marker in MARKERS[fmt] if marker in added}


def new_call_id() -> str:
    """A fresh tool-call id: ``call_`` and 24 random hex digits."""
    return "call_" + secrets.token_hex(12)


class ToolCallStream:
    """Incremental parsing of streamed text deltas.

    :meth:`push` releases content as soon as it cannot be tool-call markup, and the calls each delta completes.
    Held back are only text that could still start markup (a trailing ``<tool_`` for hermes, ``[TOOL_`` for
    mistral; for llama3 the whole output once its first non-blank text starts like a call) and trailing
    whitespace that would be trimmed if markup came next. :meth:`finish` releases the rest. Concatenated, the
    parts equal :func:`parse_tool_calls` of the whole text.

    Args:
        fmt: the markup family (see :func:`tool_call_format`).
        new_id: makes the id of each call, valid or not, in the order the calls were written.
        offered: the names of the tools offered to the model: a call naming another stays content. None: any
            name counts (only for text that no client sees as calls; the engine always passes the names).
    """

    def __init__(
        self, fmt: ToolCallFormat, new_id: Callable[[], str] = new_call_id, offered: Collection[str] | None = None
    ) -> None:
        parser = _PARSERS.get(fmt) if isinstance(fmt, str) else None
        if parser is None:
            raise InvalidRequestError(
                f"unknown tool-call format {fmt!r}; use one of {', '.join(map(repr, _PARSERS))} "
                "(tool_call_format() picks it from a chat template)"
            )
        if not callable(new_id):
            raise InvalidRequestError(f"new_id must be a function returning a call id, got {type(new_id).__name__}")
        if offered is not None and (isinstance(offered, str) or not all(isinstance(n, str) for n in offered)):
            raise InvalidRequestError("offered must be a collection of tool names (strings), or None")
        self._parser = parser(new_id)
        self._parser.offered = None if offered is None else frozenset(offered)
        self._finished = False

    def push(self, delta: str) -> StreamedPart:
        """Add generated text; return the content now certain and the calls this delta completed."""
        if not isinstance(delta, str):
            raise InvalidRequestError(f"a streamed delta must be a string, got {type(delta).__name__}")
        self._check_open("push")
        self._parser.feed(delta, final=False)
        return self._parser.drain()

    def finish(self) -> StreamedPart:
        """End the text; return everything still held: content, calls and invalid calls (a ``<tool_call>``
        block left open whose JSON does not parse is invalid with error ``unterminated``).
        """
        self._check_open("finish")
        self._finished = True
        self._parser.feed("", final=True)
        return self._parser.drain()

    def _check_open(self, method: str) -> None:
        if self._finished:
            raise InvalidRequestError(f"{method}() after finish(): start a new ToolCallStream for each output")


def parse_tool_calls(
    text: str, fmt: ToolCallFormat, new_id: Callable[[], str] = new_call_id, offered: Collection[str] | None = None
) -> ParsedOutput:
    """Split a whole generated text into content, tool calls and invalid tool calls.

    Args:
        text: the model's output.
        fmt: the markup family (see :func:`tool_call_format`).
        new_id: makes the id of each call, valid or not, in the order the calls were written.
        offered: the names of the tools offered to the model: a call naming another stays content (None: any
            name counts).
    """
    if not isinstance(text, str):
        raise InvalidRequestError(f"text must be a string, got {type(text).__name__}")
    stream = ToolCallStream(fmt, new_id, offered)
    first = stream.push(text)
    last = stream.finish()
    return ParsedOutput(
        first.content + last.content,
        first.tool_calls + last.tool_calls,
        first.invalid_tool_calls + last.invalid_tool_calls,
    )


def _kind(value: Any) -> str:
    """The JSON type of a decoded value, for error messages."""
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list):
        return "a list"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    return "null"


def _raw(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _malformed(error: json.JSONDecodeError) -> str:
    return f"malformed JSON: {error.msg} (line {error.lineno}, column {error.colno})"


def _decode_arguments(value: Any) -> tuple[dict[str, Any] | None, str]:
    """The arguments as a JSON object, or None and why not. A string holding a JSON object is decoded."""
    if isinstance(value, dict):
        return value, ""
    if isinstance(value, str):
        try:
            inner = _loads(value)
        except json.JSONDecodeError as error:
            return None, f"arguments are a string that is not JSON ({error.msg})"
        if isinstance(inner, dict):
            return inner, ""
        return None, f"arguments are a string holding {_kind(inner)}, not a JSON object"
    return None, f"arguments must be a JSON object, got {_kind(value)}"


_NAME = re.compile(r'"name"\s*:\s*"([^"\\]*)"')


def _name_of(text: str) -> str | None:
    """The name an undecodable call gives at its shallowest nesting (the call's own ``"name": "..."``, not an
    argument's of that key), None if it gives none: so a broken call of a tool not offered stays content too.
    """
    depth, found, shallowest = 0, None, None
    at = 0
    while at < len(text):
        char = text[at]
        if char == '"':
            name = _NAME.match(text, at)
            if name and (shallowest is None or depth < shallowest):
                found, shallowest = name.group(1), depth
            at = _string_end(text, at)
            continue
        depth += 1 if char in "{[" else -1 if char in "}]" else 0
        at += 1
    return found


def _string_end(text: str, start: int) -> int:
    """Where the JSON string opening at ``start`` ends (after its closing quote; the text's end if cut)."""
    at = start + 1
    while at < len(text) and text[at] != '"':
        at += 2 if text[at] == "\\" else 1
    return min(at + 1, len(text))


def _cut_off(error: json.JSONDecodeError) -> bool:
    """Whether JSON failed to decode because the text ended inside it (not because it is malformed)."""
    return error.msg.startswith("Unterminated string") or error.pos >= len(error.doc.rstrip())


def _call_key(value: Any) -> str | None:
    """The arguments' key of a call written without markup: ``value`` is a JSON object of a string ``name`` and
    ``arguments`` (or ``parameters``), nothing else; None when it is not such an object.
    """
    if not isinstance(value, dict) or len(value) != 2 or not isinstance(value.get("name"), str):
        return None
    return next((key for key in ("arguments", "parameters") if key in value), None)


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of ``text`` that is a proper start of ``tag``."""
    for size in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:size]):
            return size
    return 0


class _Parser:
    """What every family's parser shares: the unparsed text, what was found since the last drain, and the
    content pieces (trimmed next to removed markup, joined by a blank line).
    """

    def __init__(self, new_id: Callable[[], str]) -> None:
        self.new_id = new_id
        self.offered: frozenset[str] | None = None
        self.buf = ""
        self.content: list[str] = []
        self.calls: list[ToolCall] = []
        self.invalid: list[InvalidToolCall] = []
        self.any_content = False
        self.piece_has_text = False
        self.trim_start = False

    def feed(self, delta: str, final: bool) -> None:
        """Take more text; with ``final`` the text is complete and nothing may stay held."""
        raise NotImplementedError

    def drain(self) -> StreamedPart:
        """What was found since the last drain."""
        part = StreamedPart("".join(self.content), tuple(self.calls), tuple(self.invalid))
        self.content, self.calls, self.invalid = [], [], []
        return part

    def new_piece(self, after_markup: bool) -> None:
        """Start a piece of content; one right after markup loses its leading whitespace."""
        self.piece_has_text = False
        self.trim_start = after_markup

    def emit(self, text: str) -> None:
        """Release content of the current piece."""
        if not text:
            return
        if not self.piece_has_text:
            self.piece_has_text = True
            if self.any_content:
                self.content.append(_SEPARATOR)
            self.any_content = True
        self.content.append(text)

    def prose(self, tag: str) -> bool:
        """Release the content in ``buf`` up to ``tag``; True when the tag was found (``buf`` then holds the text
        after it). Held back: an end that could grow into the tag and the whitespace before it.
        """
        text = self.buf
        if self.trim_start:
            text = text.lstrip()
            self.trim_start = not text
        at = text.find(tag)
        if at >= 0:
            self.emit(text[:at].rstrip())
            self.buf = text[at + len(tag) :]
            return True
        end = len(text[: len(text) - _partial_suffix(text, tag)].rstrip())
        self.emit(text[:end])
        self.buf = text[end:]
        return False

    def flush_prose(self) -> None:
        """Release the rest of ``buf`` as content: the text has ended, no markup follows."""
        self.emit(self.buf.lstrip() if self.trim_start else self.buf)
        self.buf = ""

    def offers(self, name: str | None) -> bool:
        """Whether ``name`` is a tool the model may call (any name when no tools were named)."""
        return bool(name) and (self.offered is None or name in self.offered)

    def not_offered(self, name: Any, written: str) -> bool:
        """True when ``name`` is a tool name that was not offered: then ``written`` (the call's text) was
        released as content (:meth:`as_content`).
        """
        if not isinstance(name, str) or not name or self.offers(name):
            return False
        self.as_content(written)
        return True

    def as_content(self, written: str) -> None:
        """Release text that looked like a call but is none, as a piece of content of its own (hermes: in place)."""
        self.new_piece(after_markup=False)
        self.emit(written)
        self.new_piece(after_markup=True)

    def add_invalid(self, name: str | None, raw: str, error: str, written: str | None = None) -> None:
        """Record an undecodable call; ``written``: its text with markup, content if ``name`` was not offered."""
        if not self.not_offered(name, raw if written is None else written):
            self.invalid.append(InvalidToolCall(name, raw, self.new_id(), error))

    def add_call(self, name: Any, arguments: Any, whole: Any = None, written: str = "") -> None:
        """Record a call from its decoded name and arguments (``whole``: the object they came from, shown as
        the raw text of a call without a usable name; ``written``: the call's text, content if ``name`` was
        not offered).
        """
        if self.not_offered(name, written):
            return
        call_id = self.new_id()
        if not isinstance(name, str) or not name:
            error = 'the call has no "name"' if name in (None, "") else f'"name" must be a string, got {_kind(name)}'
            raw = _raw(arguments if whole is None else whole)
            self.invalid.append(InvalidToolCall(None, raw, call_id, error))
            return
        decoded, error = _decode_arguments(arguments)
        if decoded is None:
            self.invalid.append(InvalidToolCall(name, _raw(arguments), call_id, error))
        else:
            self.calls.append(ToolCall(name, decoded, call_id))

    def add_object(self, value: Any, keys: tuple[str, ...], written: str) -> None:
        """Record a call written as one JSON object with a name and arguments under the first of ``keys``
        present (none: no arguments); ``written``: its text.
        """
        if not isinstance(value, dict):
            self.add_invalid(None, _raw(value), f"a tool call must be a JSON object, got {_kind(value)}")
            return
        key = next((key for key in keys if key in value), None)
        whole = value if key is None else None
        self.add_call(value.get("name"), {} if key is None else value[key], whole, written)


class _Hermes(_Parser):
    """``<tool_call>{...}</tool_call>`` blocks among text."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self.inside = False
        self.gap = ""  # the whitespace held back before the open block: content again if its call is no call
        self.resumed = False  # a call of a tool not offered went back into the content: the piece goes on

    def as_content(self, written: str) -> None:
        """Release a call of a tool not offered in place, as written: with the whitespace before its block, in
        the same piece as the text around it (no blank lines added, none trimmed after it).
        """
        self.emit(self.gap + written)
        self.gap, self.resumed, self.trim_start = "", True, False

    def new_piece(self, after_markup: bool) -> None:
        if self.resumed:
            self.resumed = False
            return
        super().new_piece(after_markup)

    def feed(self, delta: str, final: bool) -> None:
        self.buf += delta
        while True:
            if not self.inside:
                found = self.outside(final)
                if found != "block":
                    if found is None:
                        return
                    continue
                self.inside = True
            close = self.buf.find(_HERMES_CLOSE)
            reopen = self.buf.find(_HERMES_OPEN)
            if close >= 0 and (reopen < 0 or close < reopen):
                self.block(self.buf[:close], terminated=True)
                self.buf = self.buf[close + len(_HERMES_CLOSE) :]
                self.inside = False
                self.new_piece(after_markup=True)
            elif reopen >= 0:
                # a block opened before this one was closed: this one ends there, unterminated
                self.block(self.buf[:reopen], terminated=False)
                self.buf = self.buf[reopen + len(_HERMES_OPEN) :]
            else:
                if final:
                    self.block(self.buf, terminated=False)
                    self.buf = ""
                return

    def outside(self, final: bool) -> Literal["block", "text"] | None:
        """Release the prose in ``buf`` up to a call: "block" when a ``<tool_call>`` opened (``buf`` holds what
        follows it), "text" when a call without markup was taken (or text like one released), None when more
        text is needed (or none is left). Held back: any end that could start a call, and whitespace before it.
        """
        text = self.buf
        if self.trim_start:
            text = text.lstrip()
            self.trim_start = not text
        tag, call = text.find(_HERMES_OPEN), _TEXT_CALL.search(text)
        bare = call.start() if call else -1
        if tag >= 0 and (bare < 0 or tag < bare):
            prose = text[:tag].rstrip()
            self.emit(prose)
            self.gap = text[len(prose) : tag]
            self.buf = text[tag + len(_HERMES_OPEN) :]
            return "block"
        if bare >= 0:
            start = _WRAPPER.search(text, 0, bare)
            cut = len(text[: start.start() if start else bare].rstrip())
            self.emit(text[:cut])
            self.gap = ""  # the call's text holds its whitespace
            self.buf = text[cut:]
            return "text" if self.text_call(final) else None
        if final:
            self.emit(text)
            self.buf = ""
            return None
        call_start = _TEXT_CALL_START.search(text)
        partial = max(_partial_suffix(text, _HERMES_OPEN), len(text) - call_start.start() if call_start else 0)
        held = _WRAPPER_START.search(text, 0, len(text) - partial)
        cut = len(text[: held.start() if held else len(text) - partial].rstrip())
        self.emit(text[:cut])
        self.buf = text[cut:]
        return None

    def text_call(self, final: bool) -> bool:
        """Take the call without markup that ``buf`` starts with (whitespace, a fence or a brace, then
        ``{"name":``), with the closing brace and fence that go with it; text that is no such call is released as
        content, unless the text ends inside a call of an offered tool (invalid, ``unterminated``). False when
        more text is needed to tell.
        """
        text = self.buf
        call = _TEXT_CALL.search(text)
        assert call is not None  # outside() found it
        at = call.start()
        wrapper = _WRAPPER.search(text, 0, at)
        fence, brace = (wrapper.group(1), wrapper.group(2)) if wrapper else (None, None)
        try:
            value, end = _raw_decode(text[at:])
        except json.JSONDecodeError as error:
            if not final:
                return False
            name = _name_of(text[at:])
            if _cut_off(error) and self.offers(name):
                # a call of an offered tool that the text ends inside (max_tokens): a call, not prose (#45)
                self.add_invalid(name, text[at:].rstrip(), "unterminated")
                self.buf = ""
                return True
            self.emit(text[: call.end()])
            self.buf = text[call.end() :]
            return True
        key = _call_key(value)
        if key is None:
            self.emit(text[: at + end])
            self.buf = text[at + end :]
            return True
        rest = text[at + end :]
        if brace:  # the closing braces of doubled braces (``}}}}`` when the model doubled the arguments' too)
            stripped = rest.lstrip()
            if not final and not stripped.strip("}"):
                return False
            rest = stripped.lstrip("}") if stripped.startswith("}") else rest
        if fence:
            stripped = rest.lstrip()
            if stripped.startswith("```"):
                rest = stripped[3:]
            elif not final and "```".startswith(stripped):
                return False
        self.add_call(value["name"], value[key], written=text[: len(text) - len(rest)])
        self.buf = rest
        self.new_piece(after_markup=True)
        return True

    def block(self, raw: str, terminated: bool) -> None:
        """Record the call of one block; an unterminated one counts when its JSON parses."""
        text = raw.strip()
        written = _HERMES_OPEN + raw + (_HERMES_CLOSE if terminated else "")
        try:
            value = _loads(text)
        except json.JSONDecodeError as error:
            self.add_invalid(_name_of(text), text, _malformed(error) if terminated else "unterminated", written)
            return
        self.add_object(value, ("arguments", "parameters"), written)


class _Llama3(_Parser):
    """The whole output is JSON calls (after an optional ``<|python_tag|>``), or it is content."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self.mode: Literal["start", "text", "call"] = "start"

    def feed(self, delta: str, final: bool) -> None:
        if self.mode == "text":
            self.emit(delta)
            return
        self.buf += delta
        if self.mode == "start":
            head = self.buf.lstrip()
            if head.startswith(("{", _PYTHON_TAG)):
                self.mode = "call"
            elif not final and (not head or _PYTHON_TAG.startswith(head)):
                return
            else:
                self.mode = "text"
                self.emit(self.buf)
                self.buf = ""
                return
        if final:
            self.calls_of(self.buf)
            self.buf = ""

    def calls_of(self, text: str) -> None:
        """Record the ``;``-separated JSON calls of a whole output; text after the last call is content."""
        text = text.lstrip()
        if text.startswith(_PYTHON_TAG):
            text = text[len(_PYTHON_TAG) :]
        expect_call = True
        while text := text.lstrip():
            if not text.startswith("{"):
                if expect_call:
                    self.add_invalid(None, text.rstrip(), 'expected a JSON object {"name": ..., "parameters": {...}}')
                else:
                    self.emit(text)
                return
            try:
                value, end = _raw_decode(text)
            except json.JSONDecodeError as error:
                if not self.not_offered(_name_of(text), text.rstrip()):
                    self.add_invalid(None, text.rstrip(), _malformed(error))
                return
            if self.offered is not None and not (isinstance(value, dict) and "name" in value):
                self.as_content(text[:end])  # an answer in JSON, not a call: it names no tool
            else:
                self.add_object(value, ("parameters", "arguments"), text[:end])
            text = text[end:].lstrip()
            expect_call = text.startswith(";")
            if expect_call:
                text = text[1:]


class _Mistral(_Parser):
    """Text, then ``[TOOL_CALLS]`` followed by a JSON list of calls or ``name[ARGS]{...}``, possibly repeated."""

    def __init__(self, new_id: Callable[[], str]) -> None:
        super().__init__(new_id)
        self.in_calls = False
        self.after_marker = False

    def feed(self, delta: str, final: bool) -> None:
        self.buf += delta
        if not self.in_calls:
            if not self.prose(_MISTRAL_CALLS):
                if final:
                    self.flush_prose()
                return
            self.in_calls = self.after_marker = True
        while self.step(final):
            pass

    def step(self, final: bool) -> bool:
        """Decode what starts ``buf``; False when that needs more text or nothing is left.

        Something is decided before the end of the text only when more text cannot change it: a JSON list or
        object is complete at its closing bracket. A scalar after ``[ARGS]``, or text without ``[ARGS]``, waits
        for the next ``[TOOL_CALLS]`` or the end.
        """
        text = self.buf = self.buf.lstrip()
        if not text:
            return False
        if text.startswith(_MISTRAL_CALLS):
            self.buf = text[len(_MISTRAL_CALLS) :]
            self.after_marker = True
            return True
        if not final and (_MISTRAL_CALLS.startswith(text) or _MISTRAL_ARGS.startswith(text)):
            return False
        if text[0] in "[{" and not text.startswith(_MISTRAL_ARGS):
            try:
                value, end = _raw_decode(text)
            except json.JSONDecodeError as error:
                if not final:
                    return False
                self.skip_invalid(None, text, _malformed(error))
                return True
            if isinstance(value, list):
                for item in value:
                    self.add_object(item, ("arguments", "parameters"), _raw(item))
            else:
                self.add_object(value, ("arguments", "parameters"), text[:end])
            self.buf = text[end:]
            self.after_marker = False
            return True
        args = text.find(_MISTRAL_ARGS)
        marker = text.find(_MISTRAL_CALLS)
        if args >= 0 and (marker < 0 or args < marker):
            return self.named(text[:args].strip(), text[args + len(_MISTRAL_ARGS) :].lstrip(), final)
        if marker < 0 and not final:
            return False
        piece = text if marker < 0 else text[:marker]
        if self.after_marker:
            self.add_invalid(None, piece.strip(), "expected a JSON list of calls or name[ARGS]{...} after [TOOL_CALLS]")
        else:
            # text after a call: content
            self.new_piece(after_markup=True)
            self.emit(piece if marker < 0 else piece.rstrip())
        self.buf = text[len(piece) :]
        return True

    def named(self, name: str, rest: str, final: bool) -> bool:
        """Decode the arguments of ``name[ARGS]...``; ``rest`` is the text after ``[ARGS]``."""
        if not final and (not rest or rest[0] not in '[{"'):
            return False
        if not rest:
            self.add_invalid(name or None, "", "no arguments after [ARGS]", f"{name}{_MISTRAL_ARGS}")
            self.buf = ""
            self.after_marker = False
            return True
        try:
            value, end = _raw_decode(rest)
        except json.JSONDecodeError as error:
            if not final:
                return False
            self.skip_invalid(name or None, rest, _malformed(error), f"{name}{_MISTRAL_ARGS}")
            return True
        self.add_call(name, value, written=f"{name}{_MISTRAL_ARGS}{rest[:end]}")
        self.buf = rest[end:]
        self.after_marker = False
        return True

    def skip_invalid(self, name: str | None, text: str, error: str, prefix: str = "") -> None:
        """Record the undecodable text up to the next ``[TOOL_CALLS]`` as one invalid call (``prefix``: the
        ``name[ARGS]`` written before it).
        """
        end = text.find(_MISTRAL_CALLS)
        end = len(text) if end < 0 else end
        raw = text[:end].strip()
        if not self.not_offered(name or _name_of(raw), prefix + raw):
            self.add_invalid(name, raw, error)
        self.buf = text[end:]
        self.after_marker = False


_PARSERS: dict[str, Callable[[Callable[[], str]], _Parser]] = {
    "hermes": _Hermes,
    "llama3": _Llama3,
    "mistral": _Mistral,
}
