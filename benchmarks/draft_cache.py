"""Draft prefix cache: a 5-question chat over the same documents, cold draft against warm (issue 16).

Two engines over the same models run every question side by side, in alternating order: ``cold``
(``draft_cache_mb=0``) and ``warm`` (the draft prefix cache on). The warm engine's first question is
a miss; from the second on, its draft prefills only the question and runs the look-ahead steps. Per
question: draft ms, TTFT (to the first token, everything included) and the bytes the warm cache holds.
Per length: the main model's full prefill, so TTFT speedups can be read against the bound
``1 / (kept share + draft / main)`` with the warm draft's time.

Models: ``--main`` / ``--draft`` take any model spec the engine takes; ``--main shape:<name>`` builds a
randomly initialised model of a real shape (``benchmarks/ttft.py``'s SHAPES; prefill time does not
depend on weight values). Default: the real pair ``qwen2.5-coder-1.5b`` / ``qwen2.5-coder-0.5b`` when
installed, otherwise the SmolLM2-1.7B shape with the real SmolLM2-135M as draft.

    python benchmarks/draft_cache.py                               # 2k and 4k tokens, 5 questions
    python benchmarks/draft_cache.py --lengths 1024 --questions 2  # smoke run
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # read at import: a model that is not installed fails, never downloads

import torch  # noqa: E402
from ttft import ESSAYS, ROOT, clock, first_token, machine, shape_model

from specprefill_rag import GenerationParams, SpecPrefillEngine
from specprefill_rag.backends.base import SparsePrompt
from specprefill_rag.config import DEFAULT_DRAFT_CACHE_MB
from specprefill_rag.draft.model import ModelDraft
from specprefill_rag.errors import ModelLoadError
from specprefill_rag.kvcache.prefix_cache import PrefixKVCache
from specprefill_rag.models.loading import load_model

REAL_PAIR = ("qwen2.5-coder-1.5b", "qwen2.5-coder-0.5b")
FALLBACK_PAIR = ("shape:smollm2-1.7b", "smollm2-135m")
INSTRUCTIONS = "Answer the question using the documents. Be brief."
QUESTIONS = [
    "What does the author say about how startups should choose what to work on?",
    "Why does the author think most startups fail?",
    "What advice does the author give about hiring the first employees?",
    "How should founders think about raising money?",
    "What does the author say about working on hard problems?",
]


def load_pair(main: str, draft: str, dtype: str):
    """``(main model, draft model, tokenizer)``; a ``shape:`` main shares the draft's tokenizer."""
    draft_loaded = load_model(draft, "cpu", dtype)
    if main.startswith("shape:"):
        torch_dtype = draft_loaded.model.dtype
        return shape_model(main.removeprefix("shape:"), torch_dtype, "cpu"), draft_loaded.model, draft_loaded.tokenizer
    return load_model(main, "cpu", dtype).model, draft_loaded.model, draft_loaded.tokenizer


def load_models(args):
    """``((main spec, draft spec), (main, draft, tokenizer))``: as given, else the real pair, else the fallback."""
    if args.main:
        return (args.main, args.draft), load_pair(args.main, args.draft, args.dtype)
    try:
        return REAL_PAIR, load_pair(*REAL_PAIR, args.dtype)
    except ModelLoadError as error:
        print(f"the real pair does not load ({error}); timing {FALLBACK_PAIR[0]} with {FALLBACK_PAIR[1]} as draft")
        return FALLBACK_PAIR, load_pair(*FALLBACK_PAIR, args.dtype)


def documents_of(tokenizer, length: int) -> list[str]:
    """Essay text cut into documents of 512 tokens, about ``length`` prompt tokens in all."""
    text = "\n\n".join(p.read_text() for p in sorted(ESSAYS.glob("*.txt")) if "LICENSE" not in p.name)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"][: length - 96]
    return [tokenizer.decode(ids[start : start + 512]) for start in range(0, len(ids), 512)]


def ask(engine: SpecPrefillEngine, layout) -> dict:
    stats = engine.generate_layout(layout, GenerationParams(max_new_tokens=1)).stats
    return {
        "draft_ms": stats.draft_ms,
        "ttft_ms": stats.ttft_ms,
        "draft_cached_tokens": stats.draft_cached_tokens,
        "kept_tokens": stats.kept_tokens,
    }


def run_length(engines: dict[str, SpecPrefillEngine], length: int, args) -> dict:
    cold, warm = engines["cold"], engines["warm"]
    warm.draft.prefix_cache.clear()
    documents = documents_of(cold.tokenizer, length)
    layouts = [cold.layout(question, documents, INSTRUCTIONS) for question in QUESTIONS[: args.questions]]
    full_ms = clock(lambda: first_token(cold.backend, SparsePrompt.full(layouts[0].input_ids)), "cpu")
    rows = []
    for number, layout in enumerate(layouts):
        order = ("cold", "warm") if number % 2 == 0 else ("warm", "cold")
        row = {name: ask(engines[name], layout) for name in order}
        row.update(question=number + 1, prompt_tokens=len(layout), cache_bytes=warm.draft.prefix_cache.nbytes)
        rows.append(row)
        print(json.dumps(row), flush=True)
    return {"length": length, "full_prefill_ms": full_ms, "questions": rows, "summary": summarize(rows, full_ms)}


def break_even(draft_model, tokenizer, length: int, shares: list[float]) -> list[dict]:
    """Draft scoring alone: a cold prompt against the same prompt whose first ``share`` of tokens is cached.

    What the cache's minimum reuse share rests on: after cached keys the rest runs through SDPA's
    masked kernel, so a short hit can cost more than it saves. The threshold is off here.
    """
    text = "\n\n".join(p.read_text() for p in sorted(ESSAYS.glob("*.txt")) if "LICENSE" not in p.name)
    ids = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"][: 2 * length])
    cold = ModelDraft(draft_model, look_ahead=8)
    rows = []
    for share in shares:
        cached = min(int(share * length), length - 1)
        prompt = torch.cat([ids[:cached], ids[length + cached : 2 * length]])
        warm = ModelDraft(draft_model, look_ahead=8, prefix_cache=PrefixKVCache(2**40, min_reuse_share=0.0))
        warm.score(ids[: cached + 8] if cached < length - 1 else prompt)  # an entry sharing ``cached`` tokens
        drafts, times = {"cold": cold, "warm": warm}, {}
        for name in ("cold", "warm") if len(rows) % 2 == 0 else ("warm", "cold"):
            draft = drafts[name]
            times[name] = clock(lambda draft=draft, prompt=prompt: draft.score(prompt), "cpu")
        rows.append(
            {
                "prompt_tokens": length,
                "cached_tokens": cached,
                **{f"{k}_ms": v for k, v in times.items()},
                "warm_over_cold": times["warm"] / times["cold"],
            }
        )
        print(json.dumps(rows[-1]), flush=True)
    return rows


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "n": len(values)}


def summarize(rows: list[dict], full_ms: float) -> dict:
    """Medians over the questions after the first (the warm engine's hits), and the TTFT bound with the warm draft."""
    later = rows[1:] or rows
    kept_share = statistics.median(r["warm"]["kept_tokens"] / r["prompt_tokens"] for r in later)
    warm_draft = statistics.median(r["warm"]["draft_ms"] for r in later)
    warm_ttft = statistics.median(r["warm"]["ttft_ms"] for r in later)
    bound = 1.0 / (kept_share + warm_draft / full_ms)
    return {
        "warm_over_cold_draft": spread([r["warm"]["draft_ms"] / r["cold"]["draft_ms"] for r in later]),
        "cold_ttft_ms": spread([r["cold"]["ttft_ms"] for r in later]),
        "warm_ttft_ms": spread([r["warm"]["ttft_ms"] for r in later]),
        "kept_share": kept_share,
        "warm_speedup": full_ms / warm_ttft,
        "warm_bound": bound,
        "warm_speedup_over_bound": full_ms / warm_ttft / bound,
        "cache_mb": rows[-1]["cache_bytes"] / 2**20,
    }


def markdown(report: dict) -> str:
    lines = [
        "| prompt tokens | question | cold draft ms | warm draft ms | cached tokens | cold TTFT ms | warm TTFT ms "
        "| cache MB |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for result in report["results"]:
        for row in result["questions"]:
            cold, warm = row["cold"], row["warm"]
            cells = [
                f"{row['prompt_tokens']:,}",
                str(row["question"]),
                f"{cold['draft_ms']:,.0f}",
                f"{warm['draft_ms']:,.0f}",
                f"{warm['draft_cached_tokens']:,}",
                f"{cold['ttft_ms']:,.0f}",
                f"{warm['ttft_ms']:,.0f}",
                f"{row['cache_bytes'] / 2**20:,.0f}",
            ]
            lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| prompt tokens | full prefill ms | warm/cold draft (median, min-max) | warm TTFT speedup | bound "
        "| of the bound |",
        "|---|---|---|---|---|---|",
    ]
    for result in report["results"]:
        s = result["summary"]
        ratio = s["warm_over_cold_draft"]
        lines.append(
            f"| {result['questions'][0]['prompt_tokens']:,} | {result['full_prefill_ms']:,.0f} "
            f"| {ratio['median']:.3f} ({ratio['min']:.3f}-{ratio['max']:.3f}) | {s['warm_speedup']:.2f}x "
            f"| {s['warm_bound']:.2f}x | {s['warm_speedup_over_bound']:.2f} |"
        )
    if report.get("break_even"):
        lines += [
            "",
            "| prompt tokens | cached tokens | cold draft ms | hit draft ms | hit / cold |",
            "|---|---|---|---|---|",
        ]
        lines += [
            f"| {r['prompt_tokens']:,} | {r['cached_tokens']:,} | {r['cold_ms']:,.0f} | {r['warm_ms']:,.0f} "
            f"| {r['warm_over_cold']:.2f} |"
            for r in report["break_even"]
        ]
    return "\n".join(lines)


def main() -> None:
    options = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    options.add_argument("--main", help=f"default: {REAL_PAIR[0]} if installed, else {FALLBACK_PAIR[0]}")
    options.add_argument("--draft", help=f"default: {REAL_PAIR[1]} if installed, else {FALLBACK_PAIR[1]}")
    options.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16"])
    options.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    options.add_argument("--questions", type=int, default=5, choices=range(1, len(QUESTIONS) + 1))
    options.add_argument("--keep-rate", type=float, default=0.1)
    options.add_argument(
        "--hit-shares",
        type=float,
        nargs="*",
        default=[],
        help="also time the draft alone with these shares of each prompt cached (break-even study)",
    )
    options.add_argument("--out", type=Path)
    args = options.parse_args()
    if bool(args.main) != bool(args.draft):
        options.error("pass --main and --draft together (they must share a tokenizer)")
    (main_spec, draft_spec), (main_model, draft_model, tokenizer) = load_models(args)
    # main_cache_mb=0: the study is the draft's cache; questions over the same documents share sparse prefixes that
    # the main model's prefix cache would otherwise serve in both arms
    settings = dict(keep_rate=args.keep_rate, min_prompt_tokens=0, main_cache_mb=0)
    engines = {
        name: SpecPrefillEngine.from_models(main_model, tokenizer, draft_model, draft_cache_mb=size, **settings)
        for name, size in (("cold", 0), ("warm", DEFAULT_DRAFT_CACHE_MB))
    }
    warm_up = engines["cold"].layout(QUESTIONS[0], documents_of(tokenizer, 256), INSTRUCTIONS)
    for engine in engines.values():
        ask(engine, warm_up)
    report = {
        "machine": machine(),
        "main": main_spec,
        "draft": draft_spec,
        "dtype": args.dtype,
        "keep_rate": args.keep_rate,
        "results": [run_length(engines, n, args) for n in args.lengths],
    }
    if args.hit_shares:
        report["break_even"] = [
            row for n in args.lengths for row in break_even(draft_model, tokenizer, n, args.hit_shares)
        ]
    out = args.out or ROOT / "benchmarks" / "results" / "draft-cache" / main_spec.replace(":", "-")
    out.parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(report, indent=1))
    Path(f"{out}.md").write_text(markdown(report) + "\n")
    print(markdown(report))


if __name__ == "__main__":
    main()
