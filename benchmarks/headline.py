"""The headline table of BENCHMARKS.md, built from saved results (nothing is run).

One row per method and keep rate: each task's score and retention (95% CI) from its quality study, and
the TTFT speed-up over full prefill at one prompt length from ``ttft_lengths.py`` runs (one per keep
rate). Then SpecPrefill minus LongLLMLingua per task, paired per sample, and SpecPrefill minus each other
method (main metric and answer log-probability, bold where the 95% interval excludes 0).

A task may name several studies of the same samples (``squad=a.json+b.json``, say a method run later): each
row comes from the first study that ran its method, its retention against that study's own full prefill, and
paired differences read each method's records from that study too (sample ``i`` is the same prompt in each).

    python benchmarks/headline.py --length 4096 \\
        --quality niah-4k=benchmarks/results/pair-quality/niah-4k.json \\
                  squad=benchmarks/results/pair-quality/squad.json \\
        --ttft benchmarks/results/pair-ttft-lengths/keep-0.1.json benchmarks/results/pair-ttft-lengths/keep-0.3.json
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from compare import paired_differences
from quality import bootstrap_interval, summarise, table_metrics

METHODS = [
    "full",
    "specprefill",
    "specprefill-window",
    "self",
    "contiguous",
    "longllmlingua",
    "embeddings-filter",
    "random",
]
# ttft_lengths.py names the self draft by its layer count (self-11); contiguous prefills specprefill's tokens
TTFT_NAMES = {"contiguous": "specprefill"}
# quality.py names the whole draft scoring with its last 16 prompt tokens by its depth (the 0.5B's 24 layers)
QUALITY_NAMES = {"specprefill-window": "specprefill-layers24"}


def load(path: Path) -> dict:
    return json.loads(path.read_text())


def main_metric(report: dict) -> str:
    return table_metrics(report["task"], report["settings"]["max_new_tokens"])[0]


def quality_cell(row: dict | None) -> str:
    if row is None:
        return "not run"
    low, high = row["retention_ci"]
    interval = "" if row["method"] == "full" else f" ({low:.0%}-{high:.0%})"
    return f"{row['score']:.2f}, {row['retention']:.0%}{interval}"


def ttft_speedup(runs: list[dict], length: int, method: str, keep_rate: float) -> str:
    """``method``'s speed-up at the row of ``length`` tokens in the run made at ``keep_rate``."""
    if method == "full":
        return "1.00x"
    for run in runs:
        row = next((r for r in run["results"] if r["length"] == length), None)
        if run["keep_rate"] != keep_rate or row is None:
            continue
        name = TTFT_NAMES.get(method, method)
        found = [v for k, v in row["speedup"].items() if k == name or (name == "self" and k.startswith("self-"))]
        if found:  # the bound is the --draft model's: specprefill's row
            return f"{found[0]:.2f}x" + (f" (bound {row['bound']:.2f}x)" if method == "specprefill" else "")
    return "not measured"


def rows_of(reports: list[dict]) -> dict[tuple[str, float], dict]:
    """(method, keep rate) -> its summary row from the first of ``reports`` that ran it."""
    rows: dict[tuple[str, float], dict] = {}
    for report in reports:
        for row in summarise(report, main_metric(report)):
            rows.setdefault((row["method"], row["keep_rate"]), row)
    return rows


def quality_table(studies: dict[str, list[dict]], runs: list[dict], length: int, keep_rates: list[float]) -> str:
    summaries = {task: rows_of(reports) for task, reports in studies.items()}
    header = (
        ["method", "keep"]
        + [f"{task} ({main_metric(reports[0])}, n={reports[0]['samples']})" for task, reports in studies.items()]
        + [f"TTFT speed-up at {length:,} tokens"]
    )
    lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
    for method in METHODS:
        for keep_rate in [1.0] if method == "full" else keep_rates:
            recorded = QUALITY_NAMES.get(method, method)
            cells = [quality_cell(summaries[task].get((recorded, keep_rate))) for task in studies]
            if all(c == "not run" for c in cells):
                continue
            lines.append(
                f"| {method} | {keep_rate:g} | "
                + " | ".join(cells)
                + f" | {ttft_speedup(runs, length, method, keep_rate)} |"
            )
    return "\n".join(lines)


def difference_cell(values: list[float]) -> str:
    """Mean and 95% interval of paired differences, bold where the interval excludes 0."""
    low, high = bootstrap_interval(values)
    cell = f"{sum(values) / len(values):+.3f} ({low:+.2f} to {high:+.2f})"
    return f"**{cell}**" if low > 0 or high < 0 else cell


def records_of(reports: list[dict]) -> list[dict]:
    """Every method's records from the first of ``reports`` that ran it."""
    records: list[dict] = []
    for report in reports:
        earlier = {record["method"] for record in records}
        records += [record for record in report["records"] if record["method"] not in earlier]
    return records


def paired_table(studies: dict[str, list[dict]], first: str, others: list[str]) -> str:
    """``first`` minus each of ``others`` per task and keep rate: the main metric and the answer log-probability."""
    lines = ["| method | task | keep | n | main metric | answer logprob |", "|---|---|---|---|---|---|"]
    for other in others:
        for task, reports in studies.items():
            records = records_of(reports)
            recorded = QUALITY_NAMES.get(other, other)
            main = paired_differences(records, first, recorded, main_metric(reports[0]))
            logprob = paired_differences(records, first, recorded, "logprob")
            for keep_rate, values in sorted(main.items()):
                lines.append(
                    f"| {first} - {other} | {task} | {keep_rate:g} | {len(values)} | "
                    f"{difference_cell(values)} | {difference_cell(logprob[keep_rate])} |"
                )
    return "\n".join(lines)


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--quality", nargs="+", required=True, metavar="TASK=JSON[+JSON...]")
    options.add_argument("--ttft", type=Path, nargs="*", default=[], help="ttft_lengths.py results, one per keep rate")
    options.add_argument("--length", type=int, default=4096, help="the TTFT row (ttft_lengths.py --lengths value)")
    options.add_argument("--keep-rates", type=float, nargs="+", default=[0.1, 0.3])
    args = options.parse_args()
    studies = {
        task: [load(Path(path)) for path in paths.split("+")]
        for task, paths in (item.split("=", 1) for item in args.quality)
    }
    runs = [load(path) for path in args.ttft]
    print(quality_table(studies, runs, args.length, args.keep_rates))
    print()
    print(paired_table(studies, "specprefill", ["longllmlingua"]))
    print()
    others = [m for m in METHODS if m not in ("full", "specprefill", "longllmlingua")]
    print(paired_table(studies, "specprefill", others))


if __name__ == "__main__":
    main()
