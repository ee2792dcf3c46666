"""Soak: 500 in-process requests on one engine, resident memory every 50 (BENCHMARKS.md, "Soak").

The embedded SmolLM2-135M is draft and main; prompts are small (three 40-word documents) and always
compressed (``min_prompt_tokens=0``), so every good request runs the draft, the sparse prefill and a
short decode. One request in five is bad, cycling through the typed errors (lone surrogate, NaN keep
rate, unknown option, bytes that are not UTF-8, a prompt over ``max_draft_tokens``, ``max_new_tokens``
over the context); good requests rotate between ``generate``, ``stream`` and ``agenerate``. After every
50 requests the script collects garbage and reads the process's resident memory (VmRSS). The slope is a
least-squares line over the samples after the first (which includes the warm-up's allocator growth).

Every new prompt's draft KV goes into the draft prefix cache (about 5 MB for these ~200-token prompts
in bfloat16), so resident memory grows until the cache reaches its bound and is flat after: run with
a small bound to see the plateau within 500 requests, and with the cache off.

    OMP_NUM_THREADS=1 python benchmarks/soak.py --draft-cache-mb 256   # benchmarks/results/soak/cache-256.*
    OMP_NUM_THREADS=1 python benchmarks/soak.py --draft-cache-mb 0     # the cache off
    python benchmarks/soak.py --requests 100 --every 25                # a short run

One torch thread on a shared machine: with two, each parallel region waits for a thread another
process has descheduled, and small requests ran 30-80x slower here.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import resource
import statistics
import time
from pathlib import Path

import torch
from ttft import machine

from specprefill_rag import SpecPrefillEngine, SpecPrefillError
from specprefill_rag.config import DEFAULT_DRAFT_CACHE_MB

ROOT = Path(__file__).resolve().parents[1]
HAYSTACK = sorted((ROOT / "tests" / "fixtures" / "haystack").glob("*.txt"))
QUESTION = "What do the documents say about how the work is done?"
MAX_DRAFT_TOKENS = 1024
HAYSTACK_WORDS = " ".join(path.read_text() for path in HAYSTACK).split() * 2  # ~3,700 tokens


def rss_bytes() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * resource.getpagesize()


def documents(index: int, words: int = 40) -> list[str]:
    """Three ``words``-word passages of the haystack prose, a different window for each request."""
    start = (index * 37) % (len(HAYSTACK_WORDS) // 2)
    return [" ".join(HAYSTACK_WORDS[start + words * i : start + words * (i + 1)]) for i in range(3)]


def bad_request(engine: SpecPrefillEngine, kind: int) -> None:
    """One of six bad requests; each must raise a typed error."""
    good = documents(kind)
    calls = [
        lambda: engine.generate("When\udce9?", good),
        lambda: engine.generate(QUESTION, good, keep_rate=float("nan")),
        lambda: engine.generate(QUESTION, good, max_tokens=8),
        lambda: engine.generate(QUESTION, [b"caf\xe9"]),
        lambda: engine.generate(QUESTION, [" ".join(HAYSTACK_WORDS[:1200])], max_new_tokens=4),
        lambda: engine.generate(QUESTION, good, max_new_tokens=10**6),
    ]
    try:
        calls[kind % len(calls)]()
    except SpecPrefillError:
        return
    raise AssertionError(f"bad request {kind % len(calls)} was served")


def good_request(engine: SpecPrefillEngine, index: int, max_new_tokens: int) -> int:
    """One good request through generate, stream or agenerate; its completion tokens."""
    prompt = documents(index)
    style = index % 3
    if style == 0:
        return engine.generate(QUESTION, prompt, max_new_tokens=max_new_tokens).stats.completion_tokens
    if style == 1:
        chunks = list(engine.stream(QUESTION, prompt, max_new_tokens=max_new_tokens))
        return chunks[-1].stats.completion_tokens
    result = asyncio.run(engine.agenerate(QUESTION, prompt, max_new_tokens=max_new_tokens))
    return result.stats.completion_tokens


def soak(args) -> dict:
    engine = SpecPrefillEngine(
        keep_rate=0.3, min_prompt_tokens=0, max_draft_tokens=MAX_DRAFT_TOKENS, draft_cache_mb=args.draft_cache_mb
    )
    samples, counts, started = [], {"good": 0, "bad": 0, "tokens": 0}, time.perf_counter()
    gc.collect()
    samples.append({"requests": 0, "rss_bytes": rss_bytes(), "elapsed_s": 0.0})
    for index in range(1, args.requests + 1):
        if index % 5 == 0:
            bad_request(engine, index // 5)
            counts["bad"] += 1
        else:
            counts["tokens"] += good_request(engine, index, args.max_new_tokens)
            counts["good"] += 1
        if index % args.every == 0:
            gc.collect()
            samples.append({"requests": index, "rss_bytes": rss_bytes(), "elapsed_s": time.perf_counter() - started})
            print(f"{index:>4} requests: RSS {samples[-1]['rss_bytes'] / 2**20:.1f} MiB", flush=True)
    steady = samples[2:]  # from the second sample after start: the first includes warm-up growth
    slope = _slope([s["requests"] for s in steady], [s["rss_bytes"] for s in steady]) if len(steady) > 1 else 0.0
    return {
        "machine": machine(),
        "requests": args.requests,
        "every": args.every,
        "counts": counts,
        "max_new_tokens": args.max_new_tokens,
        "draft_cache_mb": args.draft_cache_mb,
        "torch_threads": torch.get_num_threads(),
        "samples": samples,
        "slope_bytes_per_request": slope,
        "steady_from_request": steady[0]["requests"] if steady else None,
    }


def _slope(xs: list[int], ys: list[int]) -> float:
    mean_x, mean_y = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mean_x) * (y - mean_y) for x, y in zip(xs, ys)) / sum((x - mean_x) ** 2 for x in xs)


def markdown(report: dict) -> str:
    counts = report["counts"]
    lines = [
        f"{report['requests']} requests ({counts['good']} good, {counts['bad']} bad, {counts['tokens']} tokens "
        f"generated), embedded SmolLM2-135M as draft and main, draft prefix cache {report['draft_cache_mb']} MiB, "
        f"{report['torch_threads']} torch thread(s); {report['machine']}.",
        "",
        "| requests | RSS (MiB) | elapsed (s) |",
        "|---:|---:|---:|",
    ]
    for sample in report["samples"]:
        lines.append(f"| {sample['requests']} | {sample['rss_bytes'] / 2**20:.1f} | {sample['elapsed_s']:.0f} |")
    lines += [
        "",
        f"Slope from request {report['steady_from_request']} on: "
        f"{report['slope_bytes_per_request'] * 100 / 2**20:+.2f} MiB per 100 requests.",
    ]
    return "\n".join(lines) + "\n"


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--requests", type=int, default=500)
    options.add_argument("--every", type=int, default=50)
    options.add_argument("--max-new-tokens", type=int, default=4)
    options.add_argument(
        "--draft-cache-mb",
        type=int,
        default=DEFAULT_DRAFT_CACHE_MB,
        help="the draft prefix cache's bound (0: off); it fills with each new prompt's draft KV",
    )
    options.add_argument("--out", type=Path, help="default: benchmarks/results/soak/cache-<MB>")
    args = options.parse_args()
    args.out = args.out or ROOT / "benchmarks" / "results" / "soak" / f"cache-{args.draft_cache_mb}"
    report = soak(args)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(markdown(report))
    print(markdown(report))


if __name__ == "__main__":
    main()
