"""The per-document draft cache against joint scoring, paired, from benchmarks/quality.py runs (issue #28).

Reads runs made with ``--methods specprefill specprefill-documents [specprefill-documents-naive]
[specprefill-documents-query<NN>] [specprefill-documents-in-context]`` (or ``specprefill specprefill-la<N>``:
joint scoring at another look-ahead, or ``specprefill-layers<N>``: the draft's first N layers scoring with the
last prompt tokens as queries, each read as one more variant) and writes one table: per task, keep
rate and repair (blend, or naive, query and first sight in context where the run has them), the main model's
correctness (``contains``) with joint scoring and with the cache, the paired difference (cache - joint) with its 95%
bootstrap interval over samples, retention against the full prefill, whether the answer string survived in
the kept tokens, and the Jaccard overlap of the two methods' kept document tokens (for samples whose records
hold them). Given several runs it adds pooled rows: every run's paired samples together, per keep rate and
repair, so the tasks' samples give one tighter interval.

    python benchmarks/document_cache_report.py benchmarks/results/document-cache-quality/*.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from quality import (  # noqa: E402
    LAYERS_DOCUMENTS_METHOD,
    LAYERS_METHOD,
    LOOK_AHEAD_METHOD,
    QUERY_METHOD,
    bootstrap_interval,
    query_repair,
)

JOINT = "specprefill"
CACHED = {
    "specprefill-documents": "blend",
    "specprefill-documents-naive": "naive",
    "specprefill-documents-blend05": "blend 5%",
    "specprefill-documents-in-context": "blend, first sight in context",
}


def repair_label(method: str) -> str | None:
    """The repair a cache method's rows are labelled with, or the look-ahead of a ``specprefill-la<N>`` method
    (joint scoring with another look-ahead, no cache), or the depth of a ``specprefill-layers<N>`` one (the draft's
    first N layers, the last prompt tokens as queries, no cache); None: none of these."""
    if QUERY_METHOD.fullmatch(method):
        return f"query {query_repair(method).share:.0%}"
    if look_ahead := LOOK_AHEAD_METHOD.fullmatch(method):
        return f"no cache, look-ahead {look_ahead[1]}"
    if layers := LAYERS_METHOD.fullmatch(method):
        return f"no cache, first {layers[1]} layers, prompt-window queries"
    if layers := LAYERS_DOCUMENTS_METHOD.fullmatch(method):
        return f"{layers[2] or 'blend'}, first {layers[1]} layers, prompt-window queries"
    return CACHED.get(method)


def positions(runs: list[list[int]]) -> set[int]:
    return {p for start, end in runs for p in range(start, end)}


def jaccard(a: set[int], b: set[int]) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


Pairs = dict[tuple[float, str], tuple[list[dict], list[dict], int]]


def pairs_of(path: Path) -> Pairs:
    """Per (keep rate, repair): the joint and cached records of the samples both have, and how many of those
    samples the full prefill answered.
    """
    report = json.loads(path.read_text())
    settings, records = report["settings"], report["records"]
    by = {(r["sample"], r["method"], r["keep_rate"]): r for r in records}
    full = {r["sample"]: r for r in records if r["method"] == "full"}
    pairs: Pairs = {}
    for keep in settings["keep_rates"]:
        for method in [*CACHED, *sorted({r["method"] for r in records} - set(CACHED))]:
            repair = repair_label(method)
            if repair is None:
                continue
            samples = sorted(s for s in full if (s, JOINT, keep) in by and (s, method, keep) in by)
            if samples:
                joint = [by[(s, JOINT, keep)] for s in samples]
                cached = [by[(s, method, keep)] for s in samples]
                pairs[(keep, repair)] = (joint, cached, sum(full[s]["contains"] for s in samples))
    return pairs


def rows_of(path: Path) -> list[str]:
    return [
        paired_row([path.stem, f"{keep:g}", repair], joint, cached, full_correct)
        for (keep, repair), (joint, cached, full_correct) in pairs_of(path).items()
    ]


def pooled_rows(paths: list[Path]) -> list[str]:
    """One row per (keep rate, repair) over every run's paired samples together (each sample counted once;
    the interval resamples samples across tasks).
    """
    pooled: dict[tuple[float, str], tuple[list[dict], list[dict], int, list[str]]] = {}
    for path in paths:
        for key, (joint, cached, full_correct) in pairs_of(path).items():
            all_joint, all_cached, all_full, tasks = pooled.setdefault(key, ([], [], 0, []))
            pooled[key] = (all_joint + joint, all_cached + cached, all_full + full_correct, [*tasks, path.stem])
    return [
        paired_row([f"pooled ({', '.join(tasks)})", f"{keep:g}", repair], joint, cached, full_correct)
        for (keep, repair), (joint, cached, full_correct, tasks) in sorted(pooled.items())
    ]


def paired_row(labels: list[str], joint: list[dict], cached: list[dict], full_correct: int) -> str:
    """One table row from the same samples' joint and cached records (``full_correct``: the full prefill's)."""
    n = len(joint)
    differences = [c["contains"] - j["contains"] for c, j in zip(cached, joint)]
    low, high = bootstrap_interval(differences)
    overlaps = [
        jaccard(positions(j["kept_document_runs"]), positions(c["kept_document_runs"]))
        for j, c in zip(joint, cached)
        if "kept_document_runs" in j and "kept_document_runs" in c
    ]
    overlap = f"{statistics.mean(overlaps):.2f} (n={len(overlaps)})" if overlaps else "not recorded"
    joint_right, cached_right = sum(j["contains"] for j in joint), sum(c["contains"] for c in cached)
    cells = [
        *labels,
        str(n),
        f"{full_correct / n:.2f}",
        f"{joint_right / n:.2f}",
        f"{cached_right / n:.2f}",
        f"**{statistics.mean(differences):+.3f}** ({low:+.3f} to {high:+.3f})",
        f"{joint_right / full_correct:.0%} / {cached_right / full_correct:.0%}" if full_correct else "-",
        f"{statistics.mean(j['answer_kept'] for j in joint):.2f} / "
        f"{statistics.mean(c['answer_kept'] for c in cached):.2f}",
        overlap,
    ]
    return "| " + " | ".join(cells) + " |"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("runs", type=Path, nargs="+")
    args = parser.parse_args()
    print(
        "| task | keep | repair (or look-ahead) | n | full correct | joint correct | cache correct | "
        "cache - joint (95% CI) | retention joint / cache | answer kept joint / cache | Jaccard of kept tokens |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for path in args.runs:
        for row in rows_of(path):
            print(row)
    if len(args.runs) > 1:
        for row in pooled_rows(args.runs):
            print(row)


if __name__ == "__main__":
    main()
