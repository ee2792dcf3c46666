"""Check that the docs split lost nothing: every number-bearing line of an earlier README.md / BENCHMARKS.md
must appear in the new README.md, BENCHMARKS.md or docs/ (generated parts expanded as ``mkdocs build`` does).

    .venv/bin/python docs/check_moved.py [REV]      # REV: the commit before the split (default HEAD)

A line counts as kept when its text appears verbatim (Markdown links, emphasis and line breaks ignored),
or else when one paragraph or table row of the new text holds every number of the line (reworded). Lines
that are neither are printed; the exit status is 1 if there are any.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("docs_hooks", ROOT / "docs" / "hooks.py")
hooks = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(hooks)

NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def normalise(text: str) -> str:
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # links and images: their text
    text = re.sub(r"^#+ ", "", text.strip())  # headings moved to another level
    text = text.replace("**", "").replace("\\|", "|")
    return " ".join(text.split())


def new_corpus() -> tuple[str, list[str]]:
    texts = [(ROOT / "README.md").read_text(), (ROOT / "BENCHMARKS.md").read_text()]
    for page in sorted((ROOT / "docs").rglob("*.md")):
        uri = page.relative_to(ROOT / "docs").as_posix()
        fake = SimpleNamespace(file=SimpleNamespace(src_uri=uri))
        texts.append(hooks.on_page_markdown(page.read_text(), fake, None, None))
    blocks = []
    for text in texts:
        for block in re.split(r"\n\s*\n", text):
            rows = [line for line in block.splitlines() if line.lstrip().startswith("|")]
            blocks += [normalise(row) for row in rows] or [normalise(block)]
    return normalise("\n".join(texts)), blocks


def check(name: str, old: str, corpus: str, blocks: list[str]) -> list[str]:
    missing, verbatim, reworded, total = [], 0, 0, 0
    for line in old.splitlines():
        if not re.search(r"\d", line):
            continue
        total += 1
        text = normalise(line)
        if text in corpus:
            verbatim += 1
            continue
        numbers = set(NUMBER.findall(line))
        if any(all(re.search(rf"(?<![\d.,]){re.escape(n)}(?!\d|[.,]\d)", block) for n in numbers) for block in blocks):
            reworded += 1
            continue
        missing.append(line)
    print(
        f"{name}: {total} number-bearing lines: {verbatim} verbatim, {reworded} reworded with all their numbers "
        f"in one paragraph or row, {len(missing)} not found"
    )
    return missing


def main() -> int:
    rev = sys.argv[1] if len(sys.argv) > 1 else "HEAD"
    corpus, blocks = new_corpus()
    failed = False
    for name in ("README.md", "BENCHMARKS.md"):
        old = subprocess.run(["git", "show", f"{rev}:{name}"], cwd=ROOT, capture_output=True, text=True, check=True)
        for line in check(f"{rev}:{name}", old.stdout, corpus, blocks):
            failed = True
            print("   ", line.strip()[:200])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
