"""keep_rate="auto" against fixed rates, from a ``quality.py`` report (issue #17).

    python benchmarks/auto_tuning.py benchmarks/results/smollm2-auto/tune-squad-seed1.json
    python benchmarks/auto_tuning.py benchmarks/results/smollm2-auto/niah-all.json --held-out

The tuning table: every ``specprefill-auto*`` row (one floor, ceiling and mass share) with the
average share of document tokens it kept, its scores, and the fixed-rate ``specprefill`` curve (and
the full prompt at 1) of the same report read at that average kept share, linearly between the two
measured rates around it: the margin is what auto gains over a fixed rate of equal average kept
share. ``--held-out`` reads a ``quality.py --match-auto`` run instead: per metric, the paired
difference auto minus the fixed rate of equal average kept share, with its bootstrap 95% interval.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quality import AUTO, bootstrap_interval, summarise


def interpolate(points: list[tuple[float, float]], x: float) -> float | None:
    """``y`` at ``x`` on the polyline through ``points`` (sorted by x); None outside them."""
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= x <= x1:
            return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return None


def tuning_rows(report: dict, metric: str) -> list[dict]:
    """One row per auto setting: kept share, score, and the fixed curve's score at that kept share."""
    rows = summarise(report, metric)
    # the fixed-rate curve; keep rate 1 is the full prompt
    fixed = sorted((r["kept_share"], r["score"]) for r in rows if r["method"] in ("specprefill", "full"))
    table = []
    for row in rows:
        if row["method"].startswith(AUTO):
            at_share = interpolate(fixed, row["kept_share"])
            margin = None if at_share is None else row["score"] - at_share
            table.append({**row, "fixed_at_share": at_share, "margin": margin})
    return table


def markdown(report: dict, metrics: list[str]) -> str:
    lines = [
        "| method | mass share | kept share | "
        + " | ".join(f"{m} | fixed {m} at that share | margin" for m in metrics)
        + " |",
        "|---|---|---|" + "---|---|---|" * len(metrics),
    ]
    by_metric = [tuning_rows(report, m) for m in metrics]
    for rows in zip(*by_metric):
        cells = [f"{rows[0]['method']} | {rows[0]['keep_rate']:g} | {rows[0]['kept_share']:.3f}"]
        for row in rows:
            fixed = "n/a" if row["fixed_at_share"] is None else f"{row['fixed_at_share']:.3f}"
            margin = "n/a" if row["margin"] is None else f"{row['margin']:+.3f}"
            cells.append(f"{row['score']:.3f} | {fixed} | {margin}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def held_out(report: dict, metrics: list[str]) -> str:
    """Auto minus the one fixed ``specprefill`` rate of the report, paired per sample, for each metric."""
    records = [r for r in report["records"] if "failed" not in r]
    auto = {r["sample"]: r for r in records if r["method"] == AUTO}
    fixed = {r["sample"]: r for r in records if r["method"] == "specprefill" and r["sample"] in auto}
    rates = {r["keep_rate"] for r in fixed.values()}
    if len(rates) != 1:
        raise SystemExit(f"--held-out needs one fixed specprefill rate in the report, found {sorted(rates)}")
    lines = [
        f"auto vs fixed {rates.pop():g} on {len(fixed)} samples (kept share "
        f"{sum(auto[s]['kept_share'] for s in fixed) / len(fixed):.3f} vs "
        f"{sum(r['kept_share'] for r in fixed.values()) / len(fixed):.3f}):"
    ]
    for metric in metrics:
        differences = [auto[s][metric] - r[metric] for s, r in fixed.items()]
        low, high = bootstrap_interval(differences)
        lines.append(f"  {metric}: {sum(differences) / len(differences):+.3f} ({low:+.3f} to {high:+.3f})")
    return "\n".join(lines)


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("report", type=Path)
    options.add_argument("--metrics", nargs="+", default=["contains", "logprob"])
    options.add_argument("--held-out", action="store_true", help="a --match-auto run: auto minus the fixed rate")
    args = options.parse_args()
    report = json.loads(args.report.read_text())
    print(held_out(report, args.metrics) if args.held_out else markdown(report, args.metrics))


if __name__ == "__main__":
    main()
