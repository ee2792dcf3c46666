"""mkdocs hooks: the parts of the docs that are generated at build time, so they cannot drift.

A page asks for generated text with an HTML comment on a line of its own:

* ``<!-- settings: package.module.Model -->``: a table of a pydantic model's fields (name, type,
  default, bounds, description); ``<!-- settings: package.module.Model flags=serve -->`` adds the
  ``specprefill-rag serve`` flag that sets each field.
* ``<!-- bad-input -->``: the bad-input matrix, read from the tests that assert it.
* ``<!-- modules -->``: the map of ``specprefill_rag/``, every module with the summary of its docstring,
  grouped by subpackage in the order a request passes through them.
* ``<!-- include: path/in/the/repo.md -->``: a Markdown file from outside ``docs/`` (the README, BENCHMARKS.md,
  the adapters' READMEs, the index of benchmark results), its relative links rewritten to the pages of this site.

``on_files`` also adds the plots under ``benchmarks/results/`` to the site at the same paths, so the
benchmark pages (``docs/benchmarks/``) show them as ``results/<study>/<run>.png`` (one folder per study;
the index of the folders, ``benchmarks/results/README.md``, is written by ``benchmarks/index.py`` and included
as the page ``benchmarks/results.md``).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import logging
import math
import posixpath
import re
import sys
import types
import typing
from pathlib import Path

import annotated_types

ROOT = Path(__file__).resolve().parents[1]
log = logging.getLogger("mkdocs.hooks.specprefill")

PLACEHOLDER = re.compile(r"^<!-- (settings|bad-input|modules|include)(?::\s*(.*?))?\s*-->$", re.MULTILINE)
# Repository files included into a page: where their text lives on this site.
INCLUDED = {
    "README.md": "index.md",
    "BENCHMARKS.md": "benchmarks/index.md",
    "integrations/langchain/README.md": "integrations/langchain.md",
    "integrations/llama_index/README.md": "integrations/llamaindex.md",
    "benchmarks/results/README.md": "benchmarks/results.md",
}
MIRRORED = "benchmarks/results/"  # its .png files (in its study folders) are served at the same path
LINK = re.compile(r"(!?\[[^\]]*\])\(([^)\s]+)\)")


# -- mkdocs events ---------------------------------------------------------------------------------


def on_files(files, config):
    from mkdocs.structure.files import File  # lazily: the generators below are importable without mkdocs

    for plot in sorted((ROOT / MIRRORED).rglob("*.png")):
        files.append(File.generated(config, plot.relative_to(ROOT).as_posix(), abs_src_path=str(plot)))
    return files


def on_page_markdown(markdown, page, config, files):
    def expand(match: re.Match) -> str:
        kind, argument = match.group(1), (match.group(2) or "").strip()
        if kind == "settings":
            dotted, _, flags = argument.partition(" flags=")
            return settings_table(dotted.strip(), flags.strip() or None)
        if kind == "bad-input":
            return bad_input_page()
        if kind == "modules":
            return module_map_page()
        return include(argument, page.file.src_uri)

    return PLACEHOLDER.sub(expand, markdown)


# -- settings tables from pydantic models ----------------------------------------------------------


def settings_table(dotted: str, flags: str | None = None) -> str:
    """A Markdown table of the fields of the pydantic model ``dotted`` (``package.module.Class``)."""
    module, _, name = dotted.rpartition(".")
    model = getattr(importlib.import_module(module), name)
    finite = model.model_config.get("allow_inf_nan") is False
    options = serve_flags() if flags == "serve" else None
    header = ["setting", "type", "default", "bounds", "description"] + (["flag"] if options is not None else [])
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for field_name, field in model.model_fields.items():
        cells = [
            f"`{field_name}`",
            _code(_type_name(field.annotation)),
            _code(_default(field)),
            _bounds(field, finite),
            _cell(field.description or ""),
        ]
        if options is not None:
            cells.append(", ".join(f"`{flag}`" for flag in options.get(field_name, ())) or "")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def serve_flags() -> dict[str, tuple[str, ...]]:
    """``specprefill-rag serve``'s options by the settings field they fill (each option's dest is one)."""
    from specprefill_rag.cli import parser

    commands = next(action for action in parser()._actions if action.dest == "command")
    serve = commands.choices["serve"]
    return {action.dest: tuple(action.option_strings) for action in serve._actions if action.option_strings}


def _type_name(annotation) -> str:
    origin, arguments = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return _type_name(arguments[0])
    if origin in (typing.Union, types.UnionType):
        return " | ".join(_type_name(argument) for argument in arguments)
    if origin is typing.Literal:
        return " | ".join(repr(argument) for argument in arguments)
    if origin is tuple:
        return "tuple[" + ", ".join("..." if a is Ellipsis else _type_name(a) for a in arguments) + "]"
    if annotation is type(None):
        return "None"
    return getattr(annotation, "__name__", str(annotation))


def _default(field) -> str:
    value = field.get_default(call_default_factory=True)
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return repr(value)
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1 << 30 and value & (value - 1) == 0:
        return f"{value} (2**{int(math.log2(value))})"
    return repr(value)


def _bounds(field, finite: bool) -> str:
    symbols = {
        annotated_types.Ge: ("ge", ">="),
        annotated_types.Gt: ("gt", ">"),
        annotated_types.Le: ("le", "<="),
        annotated_types.Lt: ("lt", "<"),
    }
    parts = []
    for item in field.metadata:
        for kind, (attribute, symbol) in symbols.items():
            if isinstance(item, kind):
                parts.append(f"{symbol} {_number(getattr(item, attribute))}")
        if getattr(item, "strict", False) is True:
            parts.append("strict")
    if finite and float in _leaf_types(field.annotation):
        parts.append("finite")
    return ", ".join(parts)


def _leaf_types(annotation) -> set:
    arguments = typing.get_args(annotation)
    if typing.get_origin(annotation) is typing.Literal or not arguments:
        return {annotation}
    return set().union(*(_leaf_types(argument) for argument in arguments))


def _number(value) -> str:
    if isinstance(value, int) and value >= 1 << 30 and value & (value - 1) == 0:
        return f"2**{int(math.log2(value))}"
    return str(value)


def _code(text: str) -> str:
    return f"`{text}`" if text else ""


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


# -- the bad-input matrix from the tests -----------------------------------------------------------

# (section, test file, how its rows are read). The core and adapter tests build their rows in Python
# (comprehensions over the entry points), so they are imported; the vLLM plugin's test imports vLLM,
# which the docs environment lacks, and its rows are literals, so it is parsed.
MATRICES = [
    ("Core: engine, CLI, vLLM client, plugin checks", "tests/test_bad_input_matrix.py", "import"),
    ("LangChain adapter", "integrations/langchain/tests/unit_tests/test_bad_input_matrix.py", "import"),
    ("LlamaIndex adapter", "integrations/llama_index/tests/test_bad_input_matrix.py", "import"),
    ("vLLM plugin, through a real engine (`.venv-vllm`)", "tests/vllm/test_bad_input_matrix.py", "parse"),
]
# tests/vllm/test_bad_input_matrix.py: ROWS are refused by the plugin's check (ValueError), which vLLM turns
# into VLLMValidationError; ADMISSION_ROWS only by the engine's admission hook, which sees the prompt.
VLLM_LISTS = {
    "ROWS": "ValueError -> VLLMValidationError (HTTP 400)",
    "ADMISSION_ROWS": "VLLMValidationError (HTTP 400)",
}
VLLM_SURFACE = "vLLM plugin (admission)"


def bad_input_rows() -> list[tuple[str, str, list[tuple[str, str, str]], int]]:
    """Per test file: (section, path, [(surface, case, error)] with entry points grouped, test cases run)."""
    matrices = []
    for section, path, how in MATRICES:
        if how == "import":
            rows = _imported_rows(path)
            listed = _grouped([(row.surface, row.case, _error_of(row)) for row in rows])
            cases = len(rows)
        else:
            listed, cases = _parsed_vllm_rows(path)
        matrices.append((section, path, listed, cases))
    return matrices


def bad_input_page() -> str:
    matrices = bad_input_rows()
    listed = sum(len(rows) for _, _, rows, _ in matrices)
    cases = sum(cases for *_, cases in matrices)
    intro = (
        f"The tables below list {listed} rows; the four tests run {cases} cases (each entry point of a row "
        "is a case of its own; the vLLM plugin's rows run once on its check and once through the engine)."
    )
    out = [intro]
    for section, path, rows, count in matrices:
        out += [
            "",
            f"## {section}",
            "",
            f"`{path}`: {len(rows)} rows, {count} test cases.",
            "",
            "| surface | case | error |",
            "|---|---|---|",
        ]
        out += [f"| {_cell(surface)} | {_cell(case)} | {_cell(error)} |" for surface, case, error in rows]
    return "\n".join(out)


def _imported_rows(path: str) -> list:
    """The module's ``ROWS``, executed afresh (``mkdocs serve`` rebuilds after an edit)."""
    if str(ROOT) not in sys.path:  # the core's tests import each other as the `tests` package
        sys.path.insert(0, str(ROOT))
    name = "_docs_" + re.sub(r"\W", "_", path)
    spec = importlib.util.spec_from_file_location(name, ROOT / path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return list(module.ROWS)


def _grouped(rows: list[tuple[str, str, str]]) -> list[tuple[str, str, str]]:
    """Consecutive rows that differ only in the entry point (``engine.generate``, ``engine.stream``...) as one."""
    grouped: list[tuple[str, list[str], str, str]] = []
    for surface, case, error in rows:
        owner, dot, method = surface.rpartition(".")
        if dot and grouped and grouped[-1][0] == owner and grouped[-1][2:] == (case, error):
            grouped[-1][1].append(method)
        else:
            grouped.append((owner if dot else surface, [method] if dot else [], case, error))
    return [
        (f"{owner}.{' / '.join(methods)}" if methods else owner, case, error) for owner, methods, case, error in grouped
    ]


def _error_name(error) -> str:
    return error if isinstance(error, str) else error.__name__


def _error_of(row) -> str:
    """The row's error, with the field a gateway error names (``param``) where the row checks it."""
    param = getattr(row, "param", None)
    return _error_name(row.error) + (f", param {param}" if param else "")


def _parsed_vllm_rows(path: str) -> tuple[list[tuple[str, str, str]], int]:
    tree = ast.parse((ROOT / path).read_text(), path)
    found: dict[str, list[str]] = {}
    for node in tree.body:
        target = node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None
        if isinstance(target, ast.Name) and target.id in VLLM_LISTS:
            found[target.id] = [ast.literal_eval(row.elts[0]) for row in node.value.elts]
    if set(found) != set(VLLM_LISTS):
        raise RuntimeError(f"{path}: expected the literal lists {sorted(VLLM_LISTS)}; update docs/hooks.py")
    rows = [(VLLM_SURFACE, case, VLLM_LISTS[name]) for name, cases in found.items() for case in cases]
    # test_plugin_refuses_malformed_arguments runs ROWS; test_engine_refuses_the_request_and_keeps_serving both
    return rows, 2 * len(found["ROWS"]) + len(found["ADMISSION_ROWS"])


# -- the module map from module docstrings --------------------------------------------------------

PACKAGE = ROOT / "specprefill_rag"
# The package's folders in the order a request passes through them: the top level (entry points and what
# every step shares), the pipeline's steps, then what loads models and what serves them. A subpackage not
# named here is still mapped, after these, so a new one is never left out.
MODULE_ORDER = ("", "prompt", "draft", "selection", "kvcache", "backends", "decode", "models", "serve", "vllm_plugin")
SPHINX_ROLE = re.compile(r":[a-z]+:`(~?)([^`]+)`")


def module_summary(path: Path) -> str | None:
    """The summary of a module's docstring (its first paragraph) on one line, Sphinx roles as code, or
    None when the module has no docstring. Parsed, not imported: the vLLM plugin's modules import vLLM.
    """
    docstring = ast.get_docstring(ast.parse(path.read_text(), str(path)))
    if not docstring or not docstring.strip():
        return None
    summary = " ".join(docstring.strip().split("\n\n")[0].split())

    def role(match: re.Match) -> str:
        short, target = match.groups()
        return f"`{target.rsplit('.', 1)[-1] if short or target.startswith('.') else target}`"

    return SPHINX_ROLE.sub(role, summary).replace("``", "`")


def module_groups() -> list[tuple[str, list[Path]]]:
    """``(folder, its modules)`` in :data:`MODULE_ORDER`: the folder relative to ``specprefill_rag/`` (``""``
    for the top level) and its ``.py`` files, ``__init__.py`` first, then by name.
    """
    folders: dict[str, list[Path]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        folder = path.parent.relative_to(PACKAGE).as_posix()
        folders.setdefault("" if folder == "." else folder, []).append(path)
    order = {folder: rank for rank, folder in enumerate(MODULE_ORDER)}
    ranked = sorted(folders, key=lambda folder: (order.get(folder, len(order)), folder))
    return [(folder, sorted(folders[folder], key=lambda p: (p.name != "__init__.py", p.name))) for folder in ranked]


def module_map_page() -> str:
    """One section per folder of ``specprefill_rag/``: its package summary, then a table of its modules."""
    out = []
    for folder, paths in module_groups():
        title = f"specprefill_rag/{folder}/" if folder else "specprefill_rag/"
        out += ["", f"### `{title}`", ""]
        package, modules = paths[0], [p for p in paths if p.name != "__init__.py"]
        if package.name == "__init__.py":
            out += [_cell(module_summary(package) or "(no docstring)"), ""]
        out += ["| module | what it does |", "|---|---|"]
        out += [f"| `{p.name}` | {_cell(module_summary(p) or '(no docstring)')} |" for p in modules]
    return "\n".join(out).lstrip("\n")


# -- files from outside docs/ ----------------------------------------------------------------------


def include(path: str, page_uri: str) -> str:
    """The Markdown file ``path`` (relative to the repository) with its links made relative to ``page_uri``."""
    text = (ROOT / path).read_text()

    def relink(match: re.Match) -> str:
        label, target = match.groups()
        if re.match(r"^([a-z]+:|#)", target):
            return match.group(0)
        target_path, hash_, fragment = target.partition("#")
        repo_path = posixpath.normpath(posixpath.join(posixpath.dirname(path), target_path))
        if repo_path.startswith("docs/"):
            site_path = repo_path.removeprefix("docs/")
        elif repo_path in INCLUDED:
            site_path = INCLUDED[repo_path]
        elif repo_path.startswith(MIRRORED) and repo_path.endswith(".png"):
            site_path = repo_path
        else:
            log.warning(f"{path} links to {target}, which is not on the site: link a docs page or write it as `code`")
            return match.group(0)
        relative = posixpath.relpath(site_path, posixpath.dirname(page_uri) or ".")
        return f"{label}({relative}{hash_}{fragment})"

    return LINK.sub(relink, text)
