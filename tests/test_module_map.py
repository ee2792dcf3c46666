"""The module map of docs/design/how-it-works.md is generated from the modules' docstrings (docs/hooks.py):
every module of the package appears in it with its summary, so the map cannot go stale.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "specprefill_rag"
PAGE = ROOT / "docs" / "design" / "how-it-works.md"
MAX_SUMMARY = 250  # characters: one row of the map


@pytest.fixture(scope="module")
def hooks():
    """docs/hooks.py, loaded from its file (docs/ is not a package)."""
    spec = importlib.util.spec_from_file_location("_docs_hooks_module_map", ROOT / "docs" / "hooks.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def section(page: str, folder: str) -> str:
    """The part of the generated map under ``folder``'s heading, up to the next heading."""
    heading = f"### `specprefill_rag/{folder}`"
    assert heading in page, f"no section for specprefill_rag/{folder}"
    return page.split(heading + "\n", 1)[1].split("\n### ", 1)[0]


@pytest.mark.parametrize("path", modules(), ids=lambda p: p.relative_to(PACKAGE).as_posix())
def test_every_module_has_a_one_line_summary(hooks, path):
    summary = hooks.module_summary(path)
    assert summary, f"{path.relative_to(ROOT)} has no docstring: start it with one line that says what it is for"
    assert len(summary) <= MAX_SUMMARY, (
        f"{path.relative_to(ROOT)}: the first paragraph of its docstring is {len(summary)} characters; the module "
        f"map shows it as one line, so keep it to {MAX_SUMMARY} and put the details in a second paragraph"
    )


def test_every_module_is_in_the_map_under_its_folder(hooks):
    page = hooks.module_map_page()
    for path in modules():
        relative = path.relative_to(PACKAGE)
        folder = "" if relative.parent == Path(".") else relative.parent.as_posix() + "/"
        text = section(page, folder)
        summary = hooks._cell(hooks.module_summary(path) or "(no docstring)")
        expected = summary if path.name == "__init__.py" else f"| `{path.name}` | {summary} |"
        assert expected in text, f"{relative} is not in the module map under specprefill_rag/{folder}"


def test_the_map_follows_the_request_and_keeps_folders_it_does_not_know(hooks, tmp_path, monkeypatch):
    for folder in ("", "zeta", "prompt", "draft", "alpha"):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / "__init__.py").write_text(f'"""Package {folder or "root"}."""\n')
    docstring = "A :class:`~pkg.mod.Thing` with ``code``,\nwrapped.\n\nDetails."
    (tmp_path / "alpha" / "late.py").write_text(f'"""{docstring}"""\n')
    monkeypatch.setattr(hooks, "PACKAGE", tmp_path)
    assert [folder for folder, _ in hooks.module_groups()] == ["", "prompt", "draft", "alpha", "zeta"]
    page = hooks.module_map_page()
    assert "| `late.py` | A `Thing` with `code`, wrapped. |" in section(page, "alpha/")


def test_the_how_it_works_page_shows_the_generated_map_and_names_modules_that_exist():
    text = PAGE.read_text()
    assert re.search(r"^<!-- modules -->$", text, re.MULTILINE), "how-it-works.md must ask for the generated map"
    named = set(re.findall(r"`((?:[a-z_]+/)*[a-z_]+(?:\.py|/))`", text))
    assert named, "the prose names the modules of each step"
    missing = sorted(n for n in named if not (PACKAGE / n).exists() and not (ROOT / n).exists())
    assert not missing, f"how-it-works.md names modules that do not exist: {missing}"
