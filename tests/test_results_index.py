"""benchmarks/results/: one folder per study, each in the generated index, every result the docs name present.

The index (``benchmarks/results/README.md``) is written by ``python benchmarks/index.py``; when a test here
fails after a benchmark run or a docs edit, run that script (and give a new study folder an entry in its
``STUDIES``), or fix the path the failure names.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))

import index  # noqa: E402  (benchmarks/index.py, importable once benchmarks/ is on the path)


def test_every_folder_is_in_the_index_and_every_entry_is_a_folder():
    found, stray = index.folders()
    assert stray == [], "files outside a study folder, or not <run>.json/.md/.png"
    assert sorted(found) == sorted(index.STUDIES), "the folders against STUDIES in benchmarks/index.py"
    assert index.folder_problems() == []


def test_the_index_file_is_what_the_script_writes():
    assert index.INDEX.is_file(), "run python benchmarks/index.py"
    assert index.INDEX.read_text() == index.render(), "benchmarks/results/README.md is stale: run benchmarks/index.py"


def test_the_index_lists_every_run_of_every_folder():
    text = index.INDEX.read_text()
    found, _ = index.folders()
    for study, runs in found.items():
        assert f"| `{study}/`" in text
        for run in runs:
            assert f"| `{study}/{run}` |" in text


def test_smoke_and_busy_runs_are_apart_from_the_results():
    for name, study in index.STUDIES.items():
        assert (study.kind == "result") != name.startswith("smoke/"), name


def test_every_result_path_in_the_docs_exists():
    assert index.mentions(), "no result paths found in docs/ and BENCHMARKS.md: the pattern is broken"
    assert index.mention_problems() == []


def test_the_makefile_writes_into_study_folders_and_reads_existing_results():
    assert index.makefile_problems() == []


def test_check_passes():
    assert index.main(["--check"]) == 0


@pytest.mark.parametrize(
    ("text", "paths"),
    [
        (
            "Raw: `benchmarks/results/soak/cache-{2048,0}.{json,md}`.",
            [
                "benchmarks/results/soak/cache-2048.json",
                "benchmarks/results/soak/cache-2048.md",
                "benchmarks/results/soak/cache-0.json",
                "benchmarks/results/soak/cache-0.md",
            ],
        ),
        ("each `--out benchmarks/results/pair-quality/<task>`", ["benchmarks/results/pair-quality/*"]),
        ("![plot](results/pair-ttft-lengths/keep-0.1.png)", ["benchmarks/results/pair-ttft-lengths/keep-0.1.png"]),
        ("see benchmarks/results/serve-load/run.json.", ["benchmarks/results/serve-load/run.json"]),
    ],
)
def test_mentions_are_read_as_repository_paths(text, paths):
    (mention,) = index.mentions_in("docs/page.md", text)
    assert mention.paths() == paths


def test_a_missing_result_is_reported_and_a_written_one_is_not():
    text = """
    `benchmarks/results/pair-quality/squad.json` exists; `benchmarks/results/pair-quality/gone.json` does not.
        python benchmarks/quality.py --out benchmarks/results/pair-quality/new-run
        python benchmarks/merge.py benchmarks/results/pair-quality/new-run.json --out benchmarks/results/nowhere/x
    """
    problems = index.mention_problems(index.mentions_in("docs/page.md", text))
    assert problems == [
        "docs/page.md names benchmarks/results/pair-quality/gone.json: no such result",
        "docs/page.md names benchmarks/results/nowhere/x: no such result",
    ]


def test_a_pattern_over_every_folder_cites_no_run():
    mentioned = {m.text for m in index.mentions() if m.page == "BENCHMARKS.md"}
    assert "benchmarks/results/<study>/*.json" in mentioned
    cited = index.citations()
    assert "BENCHMARKS.md" not in cited.get("soak/cache-0", set())
    assert "BENCHMARKS.md" in cited["pair-quality/squad"]  # the headline command names it
