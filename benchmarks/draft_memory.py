"""What one prompt token costs in draft memory (README, "Resource bounds"; the basis of ``max_draft_tokens``).

For each prompt length, fresh processes each load the embedded SmolLM2-135M draft and score one prompt
of that many tokens (``ModelDraft.score``, look-ahead 8, as the engine does); the peak growth of resident
memory during the call (CPU; sampled every millisecond) or ``max_memory_allocated`` (CUDA) is the
request's draft memory. A least-squares line over the lengths gives the cost per token; the draft's KV
cache alone is ``2 x layers x kv_heads x head_dim x bytes`` per token.

    python benchmarks/draft_memory.py                      # writes benchmarks/results/draft-memory/<device>.{json,md}
    python benchmarks/draft_memory.py --lengths 512 2048 --repeats 1
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

import torch
from ttft import machine, peak_rss_growth_mb

from specprefill_rag.draft.model import ModelDraft
from specprefill_rag.models.loading import load_model

ROOT = Path(__file__).resolve().parents[1]
HAYSTACK = sorted((ROOT / "tests" / "fixtures" / "haystack").glob("*.txt"))


def prompt(tokenizer, length: int) -> torch.Tensor:
    """``[length]`` ids of real prose (the test haystack, repeated as needed)."""
    text = "\n\n".join(path.read_text() for path in HAYSTACK)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor((ids * (length // len(ids) + 1))[:length])


def probe(args) -> None:
    """Child process: print the peak memory growth (bytes) of scoring one prompt of ``args.length`` tokens."""
    loaded = load_model(args.model, args.device, args.dtype)
    draft = ModelDraft(loaded.model, args.look_ahead)
    draft.score(prompt(loaded.tokenizer, 64).to(args.device))  # warm-up: kernels and allocator pools
    ids = prompt(loaded.tokenizer, args.length).to(args.device)
    if args.device.startswith("cuda"):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        draft.score(ids)
        peak = torch.cuda.max_memory_allocated() - base
    else:
        peak = peak_rss_growth_mb(lambda: draft.score(ids)) * 2**20
    print(json.dumps({"peak_bytes": peak}))


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize


def fit(lengths: list[int], peaks: list[float]) -> tuple[float, float]:
    """Least-squares ``peak = intercept + slope * length``: (slope, intercept)."""
    mean_x, mean_y = statistics.fmean(lengths), statistics.fmean(peaks)
    slope = sum((x - mean_x) * (y - mean_y) for x, y in zip(lengths, peaks)) / sum((x - mean_x) ** 2 for x in lengths)
    return slope, mean_y - slope * mean_x


def measure(args) -> dict:
    rows = []
    for length in args.lengths:
        peaks = []
        for _ in range(args.repeats):
            command = [
                sys.executable,
                __file__,
                "--probe",
                "--length",
                str(length),
                "--device",
                args.device,
                "--dtype",
                args.dtype,
                "--look-ahead",
                str(args.look_ahead),
                "--model",
                args.model,
            ]
            out = subprocess.run(command, check=True, capture_output=True, text=True).stdout.strip().splitlines()[-1]
            peaks.append(json.loads(out)["peak_bytes"])
        rows.append({"prompt_tokens": length, "peak_bytes": peaks, "median_bytes": statistics.median(peaks)})
        print(
            f"{length:>6} tokens: median peak growth {rows[-1]['median_bytes'] / 2**20:.0f} MiB "
            f"(runs: {', '.join(f'{p / 2**20:.0f}' for p in peaks)})",
            flush=True,
        )
    slope, intercept = fit([r["prompt_tokens"] for r in rows], [r["median_bytes"] for r in rows])
    loaded = load_model(args.model, "cpu", args.dtype)
    dtype = next(loaded.model.parameters()).dtype
    return {
        "machine": machine(),
        "device": args.device,
        "model": args.model,
        "dtype": str(dtype),
        "look_ahead": args.look_ahead,
        "repeats": args.repeats,
        "rows": rows,
        "bytes_per_token": slope,
        "intercept_bytes": intercept,
        "kv_cache_bytes_per_token": kv_bytes_per_token(loaded.model.config, dtype),
    }


def markdown(report: dict) -> str:
    lines = [
        f"Draft memory per request: {report['model']} ({report['dtype']}) on {report['device']}, look-ahead "
        f"{report['look_ahead']}, {report['repeats']} fresh processes per length; {report['machine']}.",
        "",
        "| prompt tokens | peak growth, median (MiB) | runs (MiB) |",
        "|---:|---:|---|",
    ]
    for row in report["rows"]:
        runs = ", ".join(f"{p / 2**20:.0f}" for p in row["peak_bytes"])
        lines.append(f"| {row['prompt_tokens']:,} | {row['median_bytes'] / 2**20:.0f} | {runs} |")
    per_token, fixed = report["bytes_per_token"] / 1024, report["intercept_bytes"] / 2**20
    kv = report["kv_cache_bytes_per_token"] / 1024
    lines += [
        "",
        f"Fit: {per_token:.0f} KiB per prompt token + {fixed:.0f} MiB; the KV cache alone is {kv:.0f} KiB per token.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--model", default="smollm2-135m")
    options.add_argument("--device", default="cpu")
    options.add_argument("--dtype", default="auto")
    options.add_argument("--lengths", type=int, nargs="+", default=[512, 1024, 2048, 4096, 8000])
    options.add_argument("--repeats", type=int, default=3)
    options.add_argument("--look-ahead", type=int, default=8)
    options.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    options.add_argument("--length", type=int, help=argparse.SUPPRESS)
    options.add_argument("--out", type=Path)
    args = options.parse_args()
    if args.probe:
        probe(args)
        return
    report = measure(args)
    out = args.out or ROOT / "benchmarks" / "results" / "draft-memory" / args.device.split(":")[0]
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
