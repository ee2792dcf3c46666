"""keep_rate="auto" against fixed rates, from a ``quality.py`` report (issue #17).

    python benchmarks/auto_tuning.py benchmarks/results/smollm2-auto-tune-squad-seed1.json

The tuning table: every ``specprefill-auto*`` row (one floor, ceiling and mass
share) with the average share of document tokens it kept, its scores, and the fixed-rate
``specprefill`` curve (and the full prompt at 1) of the same report read at that average kept share (linear between the two
measured rates around it): the margin is what auto gains over a fixed rate of equal average kept
share. (Held-out runs compare at one matched rate instead: ``quality.py --match-auto``.)
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from quality import AUTO, summarise


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
    lines = ["| method | mass share | kept share | " + " | ".join(
        f"{m} | fixed {m} at that share | margin" for m in metrics) + " |",
        "|---|---|---|" + "---|---|---|" * len(metrics)]
    by_metric = [tuning_rows(report, m) for m in metrics]
    for rows in zip(*by_metric):
        cells = [f"{rows[0]['method']} | {rows[0]['keep_rate']:g} | {rows[0]['kept_share']:.3f}"]
        for row in rows:
            fixed = "n/a" if row["fixed_at_share"] is None else f"{row['fixed_at_share']:.3f}"
            margin = "n/a" if row["margin"] is None else f"{row['margin']:+.3f}"
            cells.append(f"{row['score']:.3f} | {fixed} | {margin}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("report", type=Path)
    options.add_argument("--metrics", nargs="+", default=["contains", "logprob"])
    args = options.parse_args()
    report = json.loads(args.report.read_text())
    print(markdown(report, args.metrics))


if __name__ == "__main__":
    main()
