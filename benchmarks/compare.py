"""Paired comparison of two methods from saved quality results (same samples, same keep rates).

    python benchmarks/compare.py benchmarks/results/pair-quality/squad.json specprefill longllmlingua

Prints, per keep rate and metric, the mean per-sample difference ``a - b`` with a bootstrap 95%
interval: a difference whose interval excludes 0 is more than the noise of this sample.
Several result files may be given (e.g. the main run and a run of extra methods on the same samples);
with ``--pool`` they are studies of different samples (several tasks) and every sample of every file counts:

    python benchmarks/compare.py --pool benchmarks/results/pair-drafts/*-layers-query.json \\
        specprefill-layers8 specprefill
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quality import bootstrap_interval


def paired_differences(records: list[dict], first: str, second: str, metric: str) -> dict[float, list[float]]:
    """keep rate -> per-sample ``first - second`` of ``metric``."""
    by_key = {(r["method"], r["keep_rate"], r["sample"]): r for r in records if metric in r}
    differences: dict[float, list[float]] = {}
    for (method, keep_rate, sample), record in by_key.items():
        other = by_key.get((second, keep_rate, sample))
        if method == first and other is not None:
            differences.setdefault(keep_rate, []).append(record[metric] - other[metric])
    return differences


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("results", type=Path, nargs="+")
    options.add_argument("first")
    options.add_argument("second")
    options.add_argument("--metrics", nargs="+", default=["contains", "f1", "logprob", "answer_kept"])
    options.add_argument("--pool", action="store_true", help="the files hold different samples: pool them all")
    args = options.parse_args()
    records = []
    for number, path in enumerate(args.results):
        loaded = json.loads(path.read_text())["records"]
        records += [{**r, "sample": (number, r["sample"])} for r in loaded] if args.pool else loaded
    print(f"| metric | keep | n | mean {args.first} - {args.second} | 95% CI |\n|---|---|---|---|---|")
    for metric in args.metrics:
        for keep_rate, values in sorted(paired_differences(records, args.first, args.second, metric).items()):
            low, high = bootstrap_interval(values)
            mean = sum(values) / len(values)
            print(f"| {metric} | {keep_rate:g} | {len(values)} | {mean:+.3f} | {low:+.2f} to {high:+.2f} |")


if __name__ == "__main__":
    main()
