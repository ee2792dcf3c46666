"""Constrained output (specprefill_rag.decode.constraints): masks, grammars, tool-call markup, cache, threads.

Random-logits walks: seeded ``torch.randn`` logits every step, masked, greedy; the text must be valid for its
format. The tiny byte-level BPE tokenizers are built offline; the SmolLM2 one is read from the embedded GGUF.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest
import torch
from tokenizers import AddedToken

from specprefill_rag.decode import constraints
from specprefill_rag.decode.constraints import ConstraintCompiler, OutputFormat, TokenConstraint, validate_format
from specprefill_rag.errors import InvalidRequestError
from specprefill_rag.testing import build_family_tokenizer, build_tokenizer

# Validation and the cache key need no xgrammar; everything that compiles does (the `constrained` extra).
needs_xgrammar = pytest.mark.skipif(constraints.xgr is None, reason="xgrammar is not installed")

RAG_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string"},
        "citations": {"type": "array", "items": {"type": "integer"}},
        "confidence": {"type": "number", "minimum": 0, "maximum": 1},
    },
    "required": ["answer", "citations", "confidence"],
    "additionalProperties": False,
}


def tool(name: str, parameters: Any = None) -> dict[str, Any]:
    function: dict[str, Any] = {"name": name, "description": f"the {name} tool"}
    if parameters is not None:
        function["parameters"] = parameters
    return {"type": "function", "function": function}


WEATHER = tool(
    "get_weather",
    {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
        "required": ["city", "days"],
    },
)
CLOCK = tool(
    "get_time",
    {"type": "object", "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}}, "required": ["zone"]},
)
TOOLS = (WEATHER, CLOCK)


def valid_arguments(name: str, arguments: Any) -> bool:
    if name == "get_weather":
        return (
            isinstance(arguments, dict)
            and set(arguments) == {"city", "days"}
            and isinstance(arguments["city"], str)
            and isinstance(arguments["days"], int)
            and not isinstance(arguments["days"], bool)
        )
    return arguments in ({"zone": "UTC"}, {"zone": "CET"})


def valid_rag_answer(value: Any) -> bool:
    return (
        isinstance(value, dict)
        and set(value) == {"answer", "citations", "confidence"}
        and isinstance(value["answer"], str)
        and isinstance(value["citations"], list)
        and all(isinstance(c, int) and not isinstance(c, bool) for c in value["citations"])
        and isinstance(value["confidence"], (int, float))
        and not isinstance(value["confidence"], bool)
        and 0 <= value["confidence"] <= 1
    )


def walk(constraint: TokenConstraint, stop_ids: list[int], seed: int, steps: int = 5000) -> tuple[list[int], bool]:
    """Greedy over masked random logits until finished (or a stop token); the tokens before the stop."""
    generator = torch.Generator().manual_seed(seed)
    tokens: list[int] = []
    for _ in range(steps):
        if constraint.finished:
            return tokens, True
        logits = torch.randn(constraint.vocab_size, generator=generator)
        constraint.mask_(logits)
        token = int(logits.argmax())
        constraint.accept(token)
        if token in stop_ids:
            return tokens, True
        tokens.append(token)
    return tokens, False


def parse_calls(text: str, family: str) -> list[tuple[str, Any]]:
    """The ``(name, arguments)`` of each call in ``text``, written in ``family``'s markup; AssertionError if not."""
    opening, closing, separator, key = {
        "hermes": ("<tool_call>\n", "\n</tool_call>", "\n", "arguments"),
        "llama3": ("", "", "; ", "parameters"),
        "mistral": ("", "", ", ", "arguments"),
    }[family]
    if family == "mistral":
        assert text.startswith("[TOOL_CALLS][") and text.endswith("]"), text
        text = text[len("[TOOL_CALLS][") : -1]
    decoder = json.JSONDecoder()
    calls, at = [], 0
    while True:
        assert text.startswith(opening, at), text[at:]
        call, at = decoder.raw_decode(text, at + len(opening))
        assert text.startswith(closing, at), text[at:]
        at += len(closing)
        assert list(call) == ["name", key], call
        calls.append((call["name"], call[key]))
        if at == len(text):
            return calls
        assert text.startswith(separator, at), text[at:]
        at += len(separator)


@pytest.fixture(scope="module")
def chatml() -> Any:
    return build_tokenizer()


@pytest.fixture(scope="module")
def compiler(chatml: Any) -> ConstraintCompiler:
    return ConstraintCompiler(chatml, len(chatml))


@pytest.fixture(scope="module")
def qwen() -> Any:
    """ChatML plus Qwen's non-special added tokens ``<tool_call>`` / ``</tool_call>``."""
    return build_family_tokenizer("qwen3")


@pytest.fixture(scope="module")
def mistral() -> Any:
    """Mistral's specials plus ``[TOOL_CALLS]``, a special (control) token as in Mistral v0.3."""
    tokenizer = build_family_tokenizer("mistral")
    tokenizer.add_tokens([AddedToken("[TOOL_CALLS]", special=True)])
    return tokenizer


@needs_xgrammar
def test_json_object_walks_parse_to_objects(chatml, compiler):
    for seed in range(10):
        tokens, finished = walk(compiler.constraint(OutputFormat("json_object")), compiler.stop_token_ids, seed)
        assert finished, seed
        assert isinstance(json.loads(chatml.decode(tokens)), dict)


@needs_xgrammar
def test_json_schema_walks_are_valid_for_the_schema(chatml, compiler):
    fmt = OutputFormat("json_schema", schema=RAG_SCHEMA)
    for seed in range(10):
        tokens, finished = walk(compiler.constraint(fmt), compiler.stop_token_ids, seed)
        assert finished, seed
        assert valid_rag_answer(json.loads(chatml.decode(tokens))), chatml.decode(tokens)


@needs_xgrammar
def test_valid_text_is_accepted_token_by_token_then_finished(chatml, compiler):
    answer = json.dumps({"answer": "The bridge opened in 1883 [1].", "citations": [1, 2], "confidence": 0.9})
    constraint = compiler.constraint(OutputFormat("json_schema", schema=RAG_SCHEMA))
    for token in chatml.encode(answer, add_special_tokens=False):
        assert not constraint.finished
        assert constraint.allowed()[token]
        constraint.accept(token)
    assert constraint.finished  # only the stop token may follow
    assert constraint.allowed().nonzero().flatten().tolist() == [chatml.eos_token_id]
    constraint.accept(chatml.eos_token_id)
    assert constraint.finished


@needs_xgrammar
def test_strict_forbids_undeclared_keys_unless_off(compiler, chatml):
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    extra = chatml.encode('{"a": 1, "b": 2}', add_special_tokens=False)

    def accepts(strict: bool) -> bool:
        constraint = compiler.constraint(OutputFormat("json_schema", schema=schema, strict=strict))
        for token in extra:
            if not constraint.allowed()[token]:
                return False
            constraint.accept(token)
        return constraint.finished

    assert not accepts(True)
    assert accepts(False)


@needs_xgrammar
def test_a_vllm_main_gets_a_non_strict_schema_as_the_grammar_compiled_here():
    """vLLM compiles its ``json`` option strictly, so strict=False goes as this grammar (EBNF) instead."""
    from xgrammar.testing import _is_grammar_accept_string

    from specprefill_rag.backends.vllm import structured_outputs

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    assert structured_outputs(OutputFormat("json_schema", schema=schema)) == {"json": schema}
    loose = structured_outputs(OutputFormat("json_schema", schema=schema, strict=False))
    assert list(loose) == ["grammar"]
    grammar = constraints.xgr.Grammar.from_ebnf(loose["grammar"])
    assert _is_grammar_accept_string(grammar, '{"a": 1, "b": 2}')
    assert not _is_grammar_accept_string(grammar, '{"b": 2}')  # the schema still holds: "a" is required
    assert not _is_grammar_accept_string(grammar, '{"a": 1,' + " " * (constraints.MAX_WHITESPACE + 1) + '"b": 2}')
    strict = constraints.json_grammar(OutputFormat("json_schema", schema=schema))
    assert not _is_grammar_accept_string(constraints.xgr.Grammar.from_ebnf(strict), '{"a": 1, "b": 2}')
    with pytest.raises(InvalidRequestError, match="cannot be compiled"):
        constraints.json_grammar(OutputFormat("json_schema", schema={"type": "strnig"}, strict=False))


@needs_xgrammar
@pytest.mark.parametrize("parallel", [True, False])
def test_hermes_walks_parse_as_tool_calls(qwen, parallel):
    compiler = ConstraintCompiler(qwen, len(qwen))
    fmt = OutputFormat("tool_call", tools=TOOLS, tool_format="hermes", parallel=parallel)
    counts = set()
    for seed in range(10):
        tokens, finished = walk(compiler.constraint(fmt), compiler.stop_token_ids, seed)
        assert finished, seed
        calls = parse_calls(qwen.decode(tokens, skip_special_tokens=False), "hermes")
        assert all(valid_arguments(name, arguments) for name, arguments in calls), calls
        assert {name for name, _ in calls} <= {"get_weather", "get_time"}
        counts.add(len(calls))
    if parallel:
        assert max(counts) > 1
    else:
        assert counts == {1}


@needs_xgrammar
def test_hermes_forces_the_added_tool_call_token(qwen):
    """``<tool_call>`` is one (non-special) added token in Qwen's tokenizer: the mask allows only it."""
    compiler = ConstraintCompiler(qwen, len(qwen))
    open_id, close_id = qwen.convert_tokens_to_ids(["<tool_call>", "</tool_call>"])
    constraint = compiler.constraint(OutputFormat("tool_call", tools=TOOLS, tool_format="hermes"))
    assert constraint.allowed().nonzero().flatten().tolist() == [open_id]
    # The tokenizer's own tokenization of a call (the markers as their single tokens) is accepted.
    text = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    tokens = qwen.encode(text, add_special_tokens=False)
    assert tokens[0] == open_id and tokens[-1] == close_id
    for token in tokens:
        constraint.accept(token)
    assert not constraint.finished  # parallel: another call may follow
    allowed = constraint.allowed()
    assert allowed[qwen.eos_token_id] and not allowed[open_id]  # the separator "\n" comes first


@needs_xgrammar
def test_hermes_spells_the_markers_in_text_without_such_tokens(chatml, compiler):
    fmt = OutputFormat("tool_call", tools=(CLOCK,), tool_format="hermes", parallel=False)
    tokens, finished = walk(compiler.constraint(fmt), compiler.stop_token_ids, seed=0)
    assert finished
    [(name, arguments)] = parse_calls(chatml.decode(tokens), "hermes")
    assert name == "get_time" and valid_arguments(name, arguments)


@needs_xgrammar
def test_llama3_walks_parse_as_tool_calls():
    tokenizer = build_family_tokenizer("llama3")
    compiler = ConstraintCompiler(tokenizer, len(tokenizer))
    fmt = OutputFormat("tool_call", tools=TOOLS, tool_format="llama3")
    for seed in range(10):
        tokens, finished = walk(compiler.constraint(fmt), compiler.stop_token_ids, seed)
        assert finished, seed
        calls = parse_calls(tokenizer.decode(tokens, skip_special_tokens=False), "llama3")
        assert all(valid_arguments(name, arguments) for name, arguments in calls), calls


@needs_xgrammar
def test_mistral_walks_parse_as_tool_calls(mistral):
    compiler = ConstraintCompiler(mistral, len(mistral))
    marker = mistral.convert_tokens_to_ids("[TOOL_CALLS]")
    fmt = OutputFormat("tool_call", tools=TOOLS, tool_format="mistral")
    for seed in range(10):
        constraint = compiler.constraint(fmt)
        assert constraint.allowed().nonzero().flatten().tolist() == [marker]  # the control token itself
        tokens, finished = walk(constraint, compiler.stop_token_ids, seed)
        assert finished, seed
        assert tokens[0] == marker
        calls = parse_calls(mistral.decode(tokens, skip_special_tokens=False), "mistral")
        assert all(valid_arguments(name, arguments) for name, arguments in calls), calls


@needs_xgrammar
def test_a_tool_without_parameters_takes_the_empty_object(compiler, chatml):
    fmt = OutputFormat("tool_call", tools=(tool("ping"), tool("pong", {})), tool_format="llama3", parallel=False)
    tokens, finished = walk(compiler.constraint(fmt), compiler.stop_token_ids, seed=3)
    assert finished
    [(name, arguments)] = parse_calls(chatml.decode(tokens), "llama3")
    assert name in ("ping", "pong") and arguments == {}


@needs_xgrammar
def test_special_tokens_and_padding_are_never_text(qwen):
    """Specials other than the stop token never appear; the stop token only where the output is complete."""
    vocab_size = len(qwen) + 7  # the logits are wider than the tokenizer (padded lm_head)
    compiler = ConstraintCompiler(qwen, vocab_size)
    specials = [qwen.convert_tokens_to_ids(t) for t in ("<|endoftext|>", "<|im_start|>")]
    eos = qwen.eos_token_id
    for fmt in (OutputFormat("json_object"), OutputFormat("tool_call", tools=TOOLS, tool_format="hermes")):
        for seed in range(5):
            constraint = compiler.constraint(fmt)
            generator = torch.Generator().manual_seed(seed)
            while not constraint.finished:
                logits = torch.randn(vocab_size, generator=generator)
                constraint.mask_(logits)
                assert torch.isinf(logits[specials]).all() and torch.isinf(logits[len(qwen) :]).all()
                complete = constraint._matcher.is_completed()
                assert bool(torch.isfinite(logits[eos])) == complete
                token = int(logits.argmax())
                constraint.accept(token)
                if token == eos:
                    break


@needs_xgrammar
def test_stop_token_ids_are_the_loops_end_tokens(chatml):
    stops = {chatml.eos_token_id, chatml.pad_token_id}  # e.g. a generation config's <|im_end|> and <|endoftext|>
    compiler = ConstraintCompiler(chatml, len(chatml), stop_token_ids=stops)
    constraint = compiler.constraint(OutputFormat("json_object"))
    for token in chatml.encode('{"a": [1, "x"]}', add_special_tokens=False):
        assert not constraint.allowed()[list(stops)].any()
        constraint.accept(token)
    assert constraint.finished
    assert set(constraint.allowed().nonzero().flatten().tolist()) == stops


@needs_xgrammar
def test_mask_on_other_dtypes_and_inference_tensors_matches_float32(compiler, chatml):
    constraint = compiler.constraint(OutputFormat("json_schema", schema=RAG_SCHEMA))
    for token in chatml.encode('{"answer": "Paris', add_special_tokens=False):
        constraint.accept(token)
    reference = torch.randn(len(chatml))
    expected = reference.clone()
    constraint.mask_(expected)
    assert torch.equal(torch.isfinite(expected), constraint.allowed())
    with torch.inference_mode():  # as the backend's forward pass returns them
        half = reference.to(torch.bfloat16)
    constraint.mask_(half)
    assert torch.equal(torch.isfinite(half), constraint.allowed())
    assert torch.equal(half[constraint.allowed()], reference.to(torch.bfloat16)[constraint.allowed()])
    strided = torch.stack([reference, reference], dim=1)[:, 0]  # a float32 view with stride 2
    constraint.mask_(strided)
    assert torch.equal(strided, expected)


@needs_xgrammar
def test_misuse_raises(compiler, chatml):
    constraint = compiler.constraint(OutputFormat("json_object"))
    with pytest.raises(ValueError, match="shape"):
        constraint.mask_(torch.zeros(len(chatml) + 1))
    with pytest.raises(RuntimeError, match="not allowed"):
        constraint.accept(chatml.eos_token_id)  # nothing written yet: an object must come first
    for token in chatml.encode("{}", add_special_tokens=False):
        constraint.accept(token)
    constraint.accept(chatml.eos_token_id)
    assert constraint.finished
    with pytest.raises(RuntimeError, match="ended"):
        constraint.mask_(torch.zeros(len(chatml)))
    with pytest.raises(RuntimeError, match="not allowed"):
        constraint.accept(0)


@needs_xgrammar
@pytest.mark.parametrize(
    "schema, problem",
    [
        ({"type": "integer", "minimum": 5, "maximum": 1}, "minimum greater than maximum"),
        ({"type": "frobnicate"}, "frobnicate"),
        ({"$ref": "#/$defs/missing"}, "missing"),
        ({"type": "string", "pattern": "(("}, "parenthesis"),
    ],
)
def test_uncompilable_schema_is_an_invalid_request(compiler, schema, problem):
    before = compiler.cached
    with pytest.raises(InvalidRequestError, match="cannot be compiled") as caught:
        compiler.constraint(OutputFormat("json_schema", schema=schema))
    assert problem in str(caught.value)
    assert compiler.cached == before  # nothing half-built is cached


@needs_xgrammar
def test_uncompilable_tool_parameters_are_an_invalid_request(compiler):
    bad = tool("f", {"type": "object", "properties": {"n": {"type": "integer", "minimum": 3, "maximum": 1}}})
    with pytest.raises(InvalidRequestError, match="cannot be compiled"):
        compiler.constraint(OutputFormat("tool_call", tools=(bad,), tool_format="hermes"))


@pytest.mark.parametrize(
    "fmt, problem",
    [
        (OutputFormat("json_schema"), "needs `schema`"),
        (OutputFormat("json_schema", schema=[{"type": "object"}]), "needs `schema`"),
        (OutputFormat("json_schema", schema={"type": "object", "default": float("nan")}), "JSON"),
        (OutputFormat("json_schema", schema={"const": object()}), "JSON"),
        (OutputFormat("json_object", schema={"type": "object"}), "kind='json_schema'"),
        (OutputFormat("json_object", tools=(WEATHER,)), "kind='tool_call'"),
        (OutputFormat("xml"), "unknown output format kind"),
        (OutputFormat("tool_call", tools=TOOLS), "tool_format"),
        (OutputFormat("tool_call", tools=TOOLS, tool_format="harmony"), "tool_format"),
        (OutputFormat("tool_call", tool_format="hermes"), "at least one tool"),
        (OutputFormat("tool_call", tools=({"type": "function", "function": {}},), tool_format="hermes"), "name"),
        (OutputFormat("tool_call", tools=({"type": "function"},), tool_format="hermes"), "name"),
        (OutputFormat("tool_call", tools=({"type": "retrieval"},), tool_format="hermes"), '"type": "function"'),
        (OutputFormat("tool_call", tools=("get_weather",), tool_format="hermes"), "tool 0"),
        (OutputFormat("tool_call", tools=(WEATHER, CLOCK, WEATHER), tool_format="hermes"), "'get_weather' repeat"),
        (OutputFormat("tool_call", tools=(tool("f", {"type": "string"}),), tool_format="hermes"), "object schema"),
        (OutputFormat("tool_call", tools=(tool("f", ["x"]),), tool_format="hermes"), "object schema"),
    ],
)
def test_validate_format_rejects_malformed_input(fmt, problem):
    with pytest.raises(InvalidRequestError) as caught:
        validate_format(fmt)
    assert problem in str(caught.value)


@needs_xgrammar
def test_the_compiler_validates_first(compiler):
    for fmt in (OutputFormat("json_schema"), OutputFormat("tool_call", tools=(WEATHER, WEATHER), tool_format="hermes")):
        with pytest.raises(InvalidRequestError):
            compiler.constraint(fmt)


@pytest.mark.parametrize(
    "fmt",
    [
        OutputFormat("json_object"),
        OutputFormat("json_schema", schema={}),
        OutputFormat("json_schema", schema=RAG_SCHEMA, strict=False),
        OutputFormat("tool_call", tools=TOOLS, tool_format="mistral", parallel=False),
        OutputFormat("tool_call", tools=({"function": {"name": "f"}},), tool_format="llama3"),  # type is optional
    ],
)
def test_validate_format_accepts_well_formed_input(fmt):
    validate_format(fmt)


@needs_xgrammar
def test_the_cache_is_bounded_in_bytes_least_recently_used_dropped_first(chatml):
    formats = [OutputFormat("json_schema", schema={"type": "array", "maxItems": n}) for n in range(3)]
    sizes = [ConstraintCompiler(chatml, len(chatml)).compiled(f).memory_size_bytes for f in formats]
    bound = max(sizes[0] + sizes[1], sizes[0] + sizes[2])  # two grammars fit, three do not
    compiler = ConstraintCompiler(chatml, len(chatml), cache_bytes=bound)
    first = compiler.compiled(formats[0])
    second = compiler.compiled(formats[1])
    assert compiler.compiled(OutputFormat("json_schema", schema={"type": "array", "maxItems": 0})) is first
    compiler.compiled(formats[2])  # drops formats[1], the least recently used
    assert compiler.cached == 2 and compiler.cache_bytes == sizes[0] + sizes[2] <= bound
    assert compiler.compiled(formats[0]) is first
    assert compiler.compiled(formats[1]) is not second  # compiled again
    assert compiler.compiles == 4
    assert compiler.cache_bytes <= bound


@needs_xgrammar
def test_a_grammar_larger_than_the_whole_cache_is_used_but_not_kept(chatml):
    fmt = OutputFormat("json_schema", schema=RAG_SCHEMA)
    compiler = ConstraintCompiler(chatml, len(chatml), cache_bytes=1)
    assert compiler.constraint(fmt) is not None
    assert compiler.cached == 0 and compiler.cache_bytes == 0


def test_cache_key_tells_formats_apart():
    keys = {
        OutputFormat("json_object").canonical_json(),
        OutputFormat("json_schema", schema={}).canonical_json(),
        OutputFormat("json_schema", schema={}, strict=False).canonical_json(),
        OutputFormat("tool_call", tools=TOOLS, tool_format="hermes").canonical_json(),
        OutputFormat("tool_call", tools=TOOLS, tool_format="hermes", parallel=False).canonical_json(),
        OutputFormat("tool_call", tools=TOOLS[::-1], tool_format="hermes").canonical_json(),
        OutputFormat("tool_call", tools=TOOLS, tool_format="llama3").canonical_json(),
    }
    assert len(keys) == 7
    # Key order inside a schema is part of the key: xgrammar writes properties in the declared order.
    a = OutputFormat("json_schema", schema={"properties": {"x": {}, "y": {}}})
    b = OutputFormat("json_schema", schema={"properties": {"y": {}, "x": {}}})
    assert a.canonical_json() != b.canonical_json()


@needs_xgrammar
def test_two_threads_compile_and_advance_at_once(qwen):
    compiler = ConstraintCompiler(qwen, len(qwen), cache_bytes=1)  # nothing kept: each compiles again
    jobs = [
        (OutputFormat("json_schema", schema=RAG_SCHEMA), 1),
        (OutputFormat("tool_call", tools=TOOLS, tool_format="hermes"), 2),
    ]
    alone = ConstraintCompiler(qwen, len(qwen))
    expected = [walk(alone.constraint(fmt), [qwen.eos_token_id], seed) for fmt, seed in jobs]
    results: dict[int, list[tuple[list[int], bool]]] = {0: [], 1: []}
    errors: list[BaseException] = []
    barrier = threading.Barrier(2)

    def run(index: int) -> None:
        fmt, seed = jobs[index]
        try:
            barrier.wait()
            for _ in range(20):
                results[index].append(walk(compiler.constraint(fmt), [qwen.eos_token_id], seed))
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert not errors
    for index in range(2):
        assert results[index] == [expected[index]] * 20


def test_without_xgrammar_the_request_is_invalid_with_an_install_hint(monkeypatch, chatml):
    monkeypatch.setattr(constraints, "xgr", None)
    with pytest.raises(InvalidRequestError, match=r"pip install 'specprefill-rag\[constrained\]'"):
        ConstraintCompiler(chatml, len(chatml))
    validate_format(OutputFormat("json_object"))  # validation itself needs no xgrammar


@needs_xgrammar
@pytest.mark.real_model
def test_smollm2_tokenizer_schema_and_hermes_markup():
    """The real 49,152-token SmolLM2 vocabulary: a valid answer's own tokens all pass, and walks are valid."""
    transformers = pytest.importorskip("transformers")
    from specprefill_rag.errors import ModelLoadError
    from specprefill_rag.models.loading import embedded_gguf

    try:
        path = embedded_gguf("smollm2-135m")
    except ModelLoadError as error:
        pytest.skip(str(error))
    tokenizer = transformers.AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    compiler = ConstraintCompiler(tokenizer, 49152, stop_token_ids=[tokenizer.eos_token_id])
    fmt = OutputFormat("json_schema", schema=RAG_SCHEMA)
    answer = json.dumps({"answer": "Gustave Eiffel's company built it [2].", "citations": [2], "confidence": 0.75})
    constraint = compiler.constraint(fmt)
    for token in tokenizer.encode(answer, add_special_tokens=False):
        assert constraint.allowed()[token]
        constraint.accept(token)
    assert constraint.finished
    for seed in range(3):
        tokens, finished = walk(compiler.constraint(fmt), compiler.stop_token_ids, seed)
        assert finished and valid_rag_answer(json.loads(tokenizer.decode(tokens)))
    hermes = OutputFormat("tool_call", tools=TOOLS, tool_format="hermes", parallel=False)
    tokens, finished = walk(compiler.constraint(hermes), compiler.stop_token_ids, seed=0)
    assert finished
    [(name, arguments)] = parse_calls(tokenizer.decode(tokens), "hermes")
    assert valid_arguments(name, arguments)
