"""Bounds on an output format, checked before its grammar is compiled.

xgrammar's compile time and memory grow with a schema's size, with the width of its ``anyOf``/``enum`` lists and,
quadratically, with the repetitions of its regular expressions (``"[a-z]{40000}"`` compiles for minutes). A compile
cannot be interrupted, so :func:`check_format_limits` refuses such a format first, in the manner of llguidance's
``ParserLimits`` (``max_grammar_size``, ``max_items_in_row``): each :class:`~specprefill_rag.config.GrammarLimits`
bound is checked without recursion (a schema nested past Python's recursion limit is refused, not crashed on), and
the error names the limit, where the schema passes it, and the fix.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from typing import Any, NoReturn

from ..config import GrammarLimits, OutputFormat
from ..errors import OutputFormatError

_BRANCHING = ("anyOf", "oneOf", "allOf")
# Keywords whose values are data, not subschemas: a "pattern" key inside them is not a regular expression.
_DATA = ("const", "enum", "default", "examples")
_QUANTIFIER = re.compile(r"\{(\d+)(,(\d*))?\}")
# Escapes followed by a braced argument (\p{L}, \u{1F600}, \x{41}, \k<name> has none): the braces are not a count.
_BRACED_ESCAPES = "pPux"


def check_format_limits(fmt: OutputFormat, limits: GrammarLimits) -> None:
    """Raise :class:`~specprefill_rag.errors.OutputFormatError` when ``fmt`` passes one of ``limits``.

    A ``json_schema`` format's schema is checked whole; a ``tool_call`` format's tools one by one (the error names
    the tool), their sizes added up against ``max_schema_bytes``.
    """
    if fmt.kind == "json_schema" and isinstance(fmt.schema, Mapping):
        _check_schema(fmt.schema, limits, None)
        _check_size(_size(fmt.schema), limits, None)
    elif fmt.kind == "tool_call":
        total = 0
        for name, parameters in _tool_parameters(fmt):
            _check_schema(parameters, limits, name)
            total += _size(parameters)
            _check_size(total, limits, name)


def _tool_parameters(fmt: OutputFormat) -> Iterator[tuple[str | None, Any]]:
    for tool in fmt.tools:
        function = tool.get("function") if isinstance(tool, Mapping) else None
        if isinstance(function, Mapping):
            name = function.get("name")
            yield (name if isinstance(name, str) else None), function.get("parameters")


def _size(schema: Any) -> int:
    """Bytes of ``schema`` as compact JSON (called after the depth check, so it cannot recurse too deep)."""
    try:
        return len(json.dumps(schema, separators=(",", ":"), ensure_ascii=False).encode())
    except (TypeError, ValueError):
        return 0  # not JSON: validate_format says so, naming the problem


def _check_size(size: int, limits: GrammarLimits, tool: str | None) -> None:
    if size > limits.max_schema_bytes:
        what = "the tools' parameters together are" if tool is not None else "the schema is"
        raise OutputFormatError(
            f"{what} {size} bytes, over the limit of {limits.max_schema_bytes} bytes of compact JSON (compiling its "
            "grammar takes time and memory in proportion); send a smaller schema or fewer tools, or raise "
            "max_schema_bytes (serve --max-schema-bytes)",
            tool=tool,
        )


def _check_schema(schema: Any, limits: GrammarLimits, tool: str | None) -> None:
    """Walk ``schema`` (iteratively) checking depth, branch and enum widths, and patterns."""
    stack: list[tuple[Any, int, str, bool]] = [(schema, 1, "", False)]
    while stack:
        value, depth, path, is_data = stack.pop()
        if not isinstance(value, (Mapping, list)):
            continue
        if depth > limits.max_schema_depth:
            _refuse(
                f"nests deeper than {limits.max_schema_depth} levels of JSON objects and arrays",
                "flatten the schema, or raise max_schema_depth (serve --max-schema-depth)",
                path,
                tool,
            )
        items = value.items() if isinstance(value, Mapping) else enumerate(value)
        if isinstance(value, Mapping) and not is_data:
            _check_keywords(value, limits, path, tool)
        for key, child in items:
            stack.append((child, depth + 1, f"{path}/{key}", is_data or key in _DATA))


def _check_keywords(schema: Mapping[str, Any], limits: GrammarLimits, path: str, tool: str | None) -> None:
    for keyword in _BRANCHING:
        branches = schema.get(keyword)
        if isinstance(branches, list) and len(branches) > limits.max_schema_branches:
            _refuse(
                f"has {len(branches)} alternatives in {keyword}, over the limit of {limits.max_schema_branches}",
                "use fewer alternatives, or raise max_schema_branches (serve --max-schema-branches)",
                f"{path}/{keyword}",
                tool,
            )
    values = schema.get("enum")
    if isinstance(values, list) and len(values) > limits.max_enum_values:
        _refuse(
            f"has {len(values)} enum values, over the limit of {limits.max_enum_values}",
            "use fewer values (or a pattern), or raise max_enum_values (serve --max-enum-values)",
            f"{path}/enum",
            tool,
        )
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        _check_pattern(pattern, limits, f"{path}/pattern", tool)
    patterns = schema.get("patternProperties")
    if isinstance(patterns, Mapping):
        for key in patterns:
            _check_pattern(str(key), limits, f"{path}/patternProperties", tool)


def _check_pattern(pattern: str, limits: GrammarLimits, path: str, tool: str | None) -> None:
    if len(pattern) > limits.max_pattern_chars:
        _refuse(
            f"has a pattern of {len(pattern)} characters, over the limit of {limits.max_pattern_chars}",
            "use a shorter pattern, or raise max_pattern_chars (serve --max-pattern-chars)",
            path,
            tool,
        )
    repeat, nested = pattern_repetition(pattern)
    if repeat > limits.max_pattern_repeat:
        _refuse(
            f"has a pattern that repeats {repeat} times (its {{n,m}} bounds, times those of the groups around "
            f"them), over the limit of {limits.max_pattern_repeat} (compile time grows with its square: 40,000 "
            "takes minutes)",
            "bound the length with minLength/maxLength instead, or raise max_pattern_repeat "
            "(serve --max-pattern-repeat)",
            path,
            tool,
        )
    if nested > limits.max_pattern_nested_repeat:
        _refuse(
            f"has a counted repetition inside another that repeats {nested} times, over the limit of "
            f"{limits.max_pattern_nested_repeat} (nested counts compile about 100 times slower than flat ones)",
            "write the inner repetition out, use * or + for one of them, or raise max_pattern_nested_repeat "
            "(serve --max-pattern-nested-repeat)",
            path,
            tool,
        )


def pattern_repetition(pattern: str) -> tuple[int, int]:
    """The largest repetition count in ``pattern`` and the largest of a counted repetition inside another.

    Each ``{n}``/``{n,m}`` (``{n,}`` counts ``n``) is multiplied by the bounds of the quantified groups around it;
    ``(1, 1)`` when it has none. ``*``, ``+`` and ``?`` cost nothing to compile and count 1.
    """
    largest = [1]  # per open group: the largest count inside it
    last = 1  # the count of the atom just read (a group's: the largest inside it)
    nested = 1
    index = 0
    while index < len(pattern):
        char = pattern[index]
        if char == "\\":
            index = _after_escape(pattern, index)
            last = 1
            continue
        if char == "[":
            index = _after_class(pattern, index)
            last = 1
            continue
        if char == "(":
            largest.append(1)
            last = 1
        elif char == ")" and len(largest) > 1:
            last = largest.pop()
            largest[-1] = max(largest[-1], last)
        elif char == "{" and (match := _QUANTIFIER.match(pattern, index)):
            low, high = int(match.group(1)), match.group(3)
            bound = max(1, int(high) if high else low)
            if last > 1 and bound > 1:
                nested = max(nested, last * bound)
            last *= bound
            largest[-1] = max(largest[-1], last)
            index = match.end()
            continue
        elif char not in "*+?|":
            last = 1
        index += 1
    return max(largest), nested


def _after_escape(pattern: str, index: int) -> int:
    """The index after the escape at ``index`` (a braced argument included)."""
    after = index + 2
    if pattern[index + 1 : index + 2] in tuple(_BRACED_ESCAPES) and pattern[after : after + 1] == "{":
        close = pattern.find("}", after)
        return close + 1 if close >= 0 else len(pattern)
    return after


def _after_class(pattern: str, index: int) -> int:
    """The index after the character class opening at ``index``."""
    cursor = index + 1
    if pattern[cursor : cursor + 1] == "^":
        cursor += 1
    if pattern[cursor : cursor + 1] == "]":
        cursor += 1
    while cursor < len(pattern) and pattern[cursor] != "]":
        cursor += 2 if pattern[cursor] == "\\" else 1
    return cursor + 1


def _refuse(problem: str, fix: str, path: str, tool: str | None) -> NoReturn:
    where = f"at {path}" if path else "at its root"
    owner = f"the parameters of tool {tool!r}" if tool is not None else "the schema"
    raise OutputFormatError(f"{owner} {problem} ({where}); {fix}", tool=tool)
