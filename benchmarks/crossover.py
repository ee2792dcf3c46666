"""Where SpecPrefill starts to pay: the prompt length below which it does not lower TTFT (issue #17, item 3).

For each ``main:draft`` pair, full prefill and SpecPrefill (the draft's scoring, selection and the sparse
prefill to the first token; ``specprefill-window``: the draft scoring with the prompt's last 16 tokens;
``self-<n>``: the main model's first layers as the draft) run at each length,
interleaved, in one process (:func:`ttft_lengths.run_length`, without its memory probe). The crossover
of a method is the shortest measured length from which its median TTFT is below full prefill's at every
longer measured length; "none" when it never is. ``min_prompt_tokens`` defaults to a length at or above
every measured crossover (README, "When SpecPrefill pays").

    OMP_NUM_THREADS=1 python benchmarks/crossover.py            # the pairs below, keep 0.3 (the default)
    python benchmarks/crossover.py --pairs smollm2-135m:smollm2-135m --lengths 128 512 --repeats 2

Results are written after every length; ``--resume`` skips the lengths a previous run measured.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

from ttft import ROOT, machine
from ttft_lengths import load_engines, run_length

from specprefill_rag.config import SpecPrefillConfig

PAIRS = ["qwen2.5-coder-1.5b:qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b:smollm2-135m", "smollm2-135m:smollm2-135m"]
LENGTHS = [128, 256, 384, 512, 768, 1024, 1536, 2048]


def crossover(rows: list[dict], method: str) -> int | None:
    """Shortest measured prompt length from which ``method``'s median TTFT is below full prefill's at
    every longer length; None when it is not below at the longest."""
    found = None
    for row in sorted(rows, key=lambda r: r["prompt_tokens"], reverse=True):
        if row["timings_ms"][method]["median"] >= row["timings_ms"]["full"]["median"]:
            break
        found = row["prompt_tokens"]
    return found


def markdown(report: dict) -> str:
    lengths = sorted({r["length"] for pair in report["pairs"] for r in pair["results"]})
    lines = [
        "| main | draft | method | " + " | ".join(f"{n:,}" for n in lengths) + " | crossover (prompt tokens) |",
        "|---|---|---|" + "---:|" * (len(lengths) + 1),
    ]
    for pair in report["pairs"]:
        rows = {r["length"]: r for r in pair["results"]}
        for method in next(iter(rows.values()))["speedup"] if rows else []:
            cells = [f"{rows[n]['speedup'][method]:.2f}x" if n in rows else "" for n in lengths]
            point = crossover(list(rows.values()), method)
            lines.append(
                f"| {pair['main']} | {'self' if method.startswith('self') else pair['draft']} | {method} | "
                + " | ".join(cells)
                + f" | {'none' if point is None else f'{point:,}'} |"
            )
    return "\n".join(lines) + "\n\nCells: full-prefill TTFT / method TTFT (medians); >1 means SpecPrefill is faster.\n"


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--pairs", nargs="+", default=PAIRS, help="main:draft model specs")
    options.add_argument("--lengths", type=int, nargs="+", default=LENGTHS)
    options.add_argument("--repeats", type=int, default=5)
    options.add_argument("--keep-rate", type=float, default=SpecPrefillConfig().keep_rate)
    options.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    options.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "crossover" / "run")
    options.add_argument("--resume", action="store_true", help="keep the lengths a previous run wrote")
    args = options.parse_args()
    path = Path(f"{args.out}.json")
    report = (
        json.loads(path.read_text())
        if args.resume and path.exists()
        else {
            "machine": machine(),
            "keep_rate": args.keep_rate,
            "repeats": args.repeats,
            "dtype": args.dtype,
            "lengths": args.lengths,
            "pairs": [],
        }
    )
    for spec in args.pairs:
        main_spec, draft_spec = spec.split(":")
        pair = next((p for p in report["pairs"] if p["main"] == main_spec and p["draft"] == draft_spec), None)
        if pair is None:
            pair = {"main": main_spec, "draft": draft_spec, "results": []}
            report["pairs"].append(pair)
        todo = [n for n in args.lengths if n not in {r["length"] for r in pair["results"]}]
        if not todo:
            continue
        study = SimpleNamespace(
            main=main_spec,
            draft=draft_spec,
            dtype=args.dtype,
            keep_rate=args.keep_rate,
            repeats=args.repeats,
            self_layers=None,
        )
        engine, window = load_engines(study)
        pair["draft_path"] = engine.draft_path
        for length in todo:
            pair["results"].append(run_length(engine, window, None, None, length, study, probe_memory=False))
            pair["results"].sort(key=lambda r: r["length"])
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(report, indent=1))
            Path(f"{args.out}.md").write_text(markdown(report))
        del engine, window
    print(markdown(report))


if __name__ == "__main__":
    main()
