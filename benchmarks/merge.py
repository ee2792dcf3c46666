"""One quality table from several runs on the same task and samples (extra keep rates, methods or samples).

    python benchmarks/merge.py benchmarks/results/quality/niah*.json --out benchmarks/results/quality/niah-all

Runs are merged only when they drew their samples the same way (task, seed, documents, length) and
generated the same way (max new tokens): then sample ``i`` is the same prompt in every run. A record
given by two runs (the full-prefill record every run repeats, or a sample evaluated again after a run
stopped) is kept once if the two agree on every result (the run time aside); if they differ, that is
an error rather than a silent choice between them. Runs of one study split over processes (say
``--only-samples 20 ... 29`` beside the main run) keep that study's settings and sample digests, so
``quality.py --resume`` continues the merged file like one run.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quality import markdown, plot, table_metrics, write_tables
from tasks import recorded_sampler

SAME_SAMPLES = ("task", "seed", "documents", "length", "max_new_tokens")
# Settings that only say how one study was split over runs (processes, stops, sample ranges)
HOW_SPLIT = ("samples", "only_samples", "out", "resume", "merged_from")


class MergeError(ValueError):
    """Runs that cannot share one table."""


def merge(reports: list[dict]) -> dict:
    """One report with every record of ``reports``; raises MergeError on a mismatch or a duplicate."""
    first = reports[0]["settings"]
    for report in reports[1:]:
        differing = [k for k in SAME_SAMPLES if report["settings"].get(k) != first.get(k)]
        if recorded_sampler(report["settings"]) != recorded_sampler(first):
            differing.append("sampler")
        if differing:
            raise MergeError(
                f"runs differ in {differing}: their sample i is not the same prompt; "
                "merge only runs made with the same --task/--seed/--documents/--length/--max-new-tokens"
            )
    records: dict[tuple, dict] = {}
    for report in reports:
        for record in report["records"]:
            key = (record["sample"], record["method"], record["keep_rate"])
            if key in records and not same_results(records[key], record):
                raise MergeError(
                    f"two runs give different results for sample {key[0]}, {key[1]} at keep {key[2]}: "
                    "they were not made the same way; merge only one of them"
                )
            records.setdefault(key, record)
    merged = sorted(records.values(), key=lambda r: (r["sample"], r["method"] != "full"))
    return {
        "task": first["task"],
        "samples": len({r["sample"] for r in merged}),
        "records": merged,
        "settings": merged_settings(reports),
        "sample_digests": merged_digests(reports),
    }


def merged_settings(reports: list[dict]) -> dict:
    """One study split over runs keeps its settings (so ``quality.py --resume`` continues it); others keep
    only what makes their samples the same."""
    first = reports[0]["settings"]
    study = {k: v for k, v in first.items() if k not in HOW_SPLIT}
    if all({k: v for k, v in r["settings"].items() if k not in HOW_SPLIT} == study for r in reports):
        samples = max(r["settings"].get("samples", r["samples"]) for r in reports)
        return study | {"samples": samples, "only_samples": None}
    return {k: first.get(k) for k in SAME_SAMPLES} | {"sampler": recorded_sampler(first)}


def merged_digests(reports: list[dict]) -> list[str]:
    """The longest run's sample digests, after checking that every run's agree with it."""
    digests = max((r.get("sample_digests", []) for r in reports), key=len)
    for report in reports:
        drawn = report.get("sample_digests", [])
        if drawn != digests[: len(drawn)]:
            raise MergeError("two runs drew different samples (their sample digests differ): merge only one of them")
    return digests


def same_results(first: dict, second: dict, tolerance: float = 1e-4) -> bool:
    """Whether two records of one (sample, method, keep rate) agree on everything but their run time."""
    for key in (first.keys() | second.keys()) - {"seconds"}:
        a, b = first.get(key), second.get(key)
        if isinstance(a, float) and isinstance(b, float) and abs(a - b) <= tolerance:
            continue
        if a != b:
            return False
    return True


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("results", type=Path, nargs="+")
    options.add_argument("--out", type=Path, required=True)
    args = options.parse_args()
    report = merge([json.loads(path.read_text()) for path in args.results])
    report["settings"]["merged_from"] = [str(path) for path in args.results]
    metrics = table_metrics(report["task"], report["settings"]["max_new_tokens"])
    args.out.parent.mkdir(parents=True, exist_ok=True)  # a study's folder, benchmarks/results/<study>/
    write_tables(report, args.out, metrics)
    plot(report, metrics, Path(f"{args.out}.png"))
    print(markdown(report, metrics[0]))


if __name__ == "__main__":
    main()
