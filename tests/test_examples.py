"""The examples use only the public API, and the demo runs (here on a tiny model)."""

import ast
import importlib.util
from pathlib import Path

import pytest

import specprefill_rag
from specprefill_rag.testing import build_model

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
PUBLIC = {
    "specprefill_rag": set(specprefill_rag.__all__),
    "langchain_specprefill": None,  # the adapters' own packages: anything they export at the top
    "llama_index.llms.specprefill": None,
}


def our_imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every import of this project's packages in ``path``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and "specprefill" in node.module:
            found += [(node.module, alias.name) for alias in node.names]
        if isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if "specprefill" in alias.name]
    return found


def test_examples_import_only_public_names():
    for path in sorted(EXAMPLES.glob("*.py")):
        for module, name in our_imports(path):
            assert module in PUBLIC, f"{path.name} imports {module}, not a public package"
            allowed = PUBLIC[module]
            assert allowed is None or name in allowed, f"{path.name} imports {module}.{name}, not in __all__"


def test_the_demo_runs_on_a_tiny_model(tokenizer, capsys):
    spec = importlib.util.spec_from_file_location("demo", EXAMPLES / "demo.py")
    demo = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(demo)
    model = build_model(tokenizer, layers=2, max_positions=4096)
    engine = specprefill_rag.SpecPrefillEngine.from_models(
        model, tokenizer, draft="self", min_prompt_tokens=0, **demo.COLD
    )
    documents = [path.read_text()[:300] for path in sorted(demo.DOCUMENTS.glob("*.txt"))]
    demo.ttft_table(engine, documents, [1.0, 0.3, "auto"], repeats=2)
    out = capsys.readouterr().out
    assert "full prefill" in out and "SpecPrefill keep 0.3" in out and "SpecPrefill keep auto" in out
    assert "Question: In what year was the Rosetta Stone found?" in out
    cached = specprefill_rag.SpecPrefillEngine.from_models(model, tokenizer, draft="self", min_prompt_tokens=0)
    with pytest.raises(ValueError, match="main_cache_mb=0"):  # its repeats would be prefix-cache hits
        demo.ttft_table(cached, documents, [1.0], repeats=2)
